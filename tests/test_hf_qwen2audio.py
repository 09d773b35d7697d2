"""Qwen2-Audio folders (`model_type = "qwen2_audio"`): the audio tower with its pooling, the one-matmul projector and a
Qwen2 LLM in one folder load into loom with transformers' logits, for several samples packed into one stream, each
with its own number of clips of its own lengths."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from qwen2audio_folders import AUDIO_ID, write_qwen2audio  # noqa: E402

from loom.data.spans import TokenSpans  # noqa: E402
from loom.models.hf import build_pretrained  # noqa: E402
from loom.models.qwen2_audio import CONTEXT_FRAMES, pooled_rows  # noqa: E402

TOL = 1e-5
FRAMES = 3000  # Qwen2AudioProcessor pads every clip's mel to 30 s
# each sample's clips (mel frames): a long one, none, two, three short ones down to a single token, a whole 30 s
CLIPS = [[1203], [], [7, 101], [4, 50, 3], [FRAMES]]


@pytest.fixture(scope="module")
def qwen2audio(tmp_path_factory):
    return write_qwen2audio(tmp_path_factory.mktemp("qwen2audio") / "folder")


def loom_clip(mel: torch.Tensor, frames: int) -> torch.Tensor:
    """A clip's padded [n_mels, 3000] features as loom's encoder takes them: its frames and the two after them
    (zeros past 30 s, as the convolutions' own padding)."""
    return torch.nn.functional.pad(mel, (0, CONTEXT_FRAMES))[:, : frames + CONTEXT_FRAMES]


def packed_samples(seed: int = 0, n_mels: int = 128):
    """Samples of text around each clip: [(ids, padded mels [n, n_mels, 3000], frames per clip)]; the padding is
    random too (the tower must not read past a clip's context frames)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, frames in enumerate(CLIPS):
        mels = torch.randn(len(frames), n_mels, FRAMES, generator=g)
        ids = torch.randint(10, 290, (3 + k,), generator=g).tolist()
        for n in frames:
            ids += [AUDIO_ID] * pooled_rows(n) + torch.randint(10, 290, (2,), generator=g).tolist()
        out.append((ids, mels, frames))
    return out


def hf_logits(ref, samples) -> torch.Tensor:
    """Each sample alone through transformers' model, its clips' padding masked as its processor masks it."""
    logits = []
    with torch.no_grad():
        for ids, mels, frames in samples:
            extra = {}
            if frames:
                mask = (torch.arange(FRAMES)[None] < torch.tensor(frames)[:, None]).long()
                extra = dict(input_features=mels, feature_attention_mask=mask)
            logits.append(ref(input_ids=torch.tensor(ids)[None], **extra).logits[0])
    return torch.cat(logits)


def loom_logits(model, samples, audio_id: int = AUDIO_ID) -> torch.Tensor:
    ids = [torch.tensor(x) for x, _, _ in samples]
    ids = torch.cat(ids)
    ids = torch.where(ids == AUDIO_ID, audio_id, ids)
    clips = [loom_clip(m, n) for _, mels, frames in samples for m, n in zip(mels, frames)]
    lengths = [len(x) for x, _, _ in samples]
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        return model(ids, positions, TokenSpans.from_lengths(lengths), {"audio": clips})


def test_a_qwen2audio_folder_gives_transformers_logits_for_packed_samples(qwen2audio):
    ref, folder = qwen2audio
    model = build_pretrained(folder).eval()
    assert model.encoder_names == ("audio",) and model.placeholder_ids["audio"] == AUDIO_ID
    samples = packed_samples()
    want = hf_logits(ref, samples)
    assert want.abs().max() > 1.0
    assert (loom_logits(model, samples) - want).abs().max() <= TOL
