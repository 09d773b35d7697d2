"""Every invariant of loom/data/packing.py's docstring, plus padded (BSHD) collation, checked against
hand-written expectations and an independent per-sample reimplementation."""

from __future__ import annotations

import pytest
import torch

from conftest import MIXED_SPECS, Spec, make_sample, text_sample
from loom.data.batch import IGNORE_INDEX, pad_samples
from loom.data.packing import pack_samples, packed_length

PAD = 300  # a pad id distinct from every byte and special token, so padding is recognisable
X = IGNORE_INDEX


# ---------------------------------------------------------------- independent reference


def _ceil_to(n: int, m: int) -> int:
    while n % m:
        n += 1
    return n


def reference_pack(samples, pad_id, multiple_of=1, pack_len=None):
    """Straightforward per-token loop: what a packed batch must contain."""
    ids, labels, positions, seg_lengths = [], [], [], []
    for s in samples:
        n = len(s.tokens)
        padded = _ceil_to(n, multiple_of)
        for i in range(padded):
            if i < n:
                ids.append(s.tokens[i])
                nxt = i + 1
                labels.append(s.tokens[nxt] if nxt < n and s.supervised[nxt] else X)
            else:
                ids.append(pad_id)
                labels.append(X)
            positions.append(i)
        seg_lengths.append(padded)
    if pack_len is not None and pack_len > len(ids):
        fill = pack_len - len(ids)
        ids += [pad_id] * fill
        labels += [X] * fill
        # the filler: up to 8 segments, each a whole number of multiples, the longer ones first
        pieces = [0] * min(8, fill // multiple_of)
        for unit in range(fill // multiple_of):
            pieces[unit % len(pieces)] += multiple_of
        for piece in pieces:
            positions += list(range(piece))
            seg_lengths.append(piece)
    cu = [0]
    for n in seg_lengths:
        cu.append(cu[-1] + n)
    return ids, labels, positions, cu


def _random_text_samples(lengths, g):
    out = []
    for n in lengths:
        toks = torch.randint(0, 256, (n,), generator=g).tolist()
        n_prompt = int(torch.randint(0, n + 1, (1,), generator=g))
        out.append(text_sample(toks, n_prompt))
    return out


# ---------------------------------------------------------------- hand-built expectations


def _two_samples():
    a = text_sample([11, 12, 13, 14], n_prompt=2)  # supervised: 13, 14
    b = text_sample([21, 22, 23], n_prompt=1)  # supervised: 22, 23
    return [a, b]


def test_hand_built_pack_no_padding():
    batch = pack_samples(_two_samples(), PAD)
    assert batch.input_ids.tolist() == [11, 12, 13, 14, 21, 22, 23]
    # 11→(12 is prompt) ignored, 12→13, 13→14, 14 is last of A: never predicts 21
    assert batch.labels.tolist() == [X, 13, 14, X, 22, 23, X]
    assert batch.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert batch.spans.cu_seqlens.tolist() == [0, 4, 7]
    assert batch.spans.cu_seqlens.dtype == torch.int32
    assert batch.spans.max_seqlen == 4
    assert batch.spans.packed and batch.spans.pad_mask is None
    assert batch.num_supervised == 4


def test_hand_built_pack_multiple_of_4():
    batch = pack_samples(_two_samples(), PAD, multiple_of=4)
    assert batch.input_ids.tolist() == [11, 12, 13, 14, 21, 22, 23, PAD]
    assert batch.labels.tolist() == [X, 13, 14, X, 22, 23, X, X]
    # the padding belongs to sample B: its positions continue, it is inside B's segment
    assert batch.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert batch.spans.cu_seqlens.tolist() == [0, 4, 8]


def test_hand_built_pack_multiple_of_4_with_filler():
    batch = pack_samples(_two_samples(), PAD, multiple_of=4, pack_len=16)
    assert batch.input_ids.tolist() == [11, 12, 13, 14, 21, 22, 23, PAD] + [PAD] * 8
    assert batch.labels.tolist() == [X, 13, 14, X, 22, 23, X, X] + [X] * 8
    # the filler is segments of its own, a whole multiple each: two of 4 (8 rows cannot make more)
    assert batch.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3] + [0, 1, 2, 3] * 2
    assert batch.spans.cu_seqlens.tolist() == [0, 4, 8, 12, 16]
    assert batch.spans.max_seqlen == 4


def test_a_long_filler_is_cut_into_eight_pieces():
    """A filler attends to itself only, so its attention costs its length squared for rows nobody reads:
    cut into 8 near-equal whole multiples, 70 rows of 2s cost 5·8² + 3·10² instead of 70²."""
    batch = pack_samples(_two_samples(), PAD, multiple_of=2, pack_len=78)
    assert batch.spans.cu_seqlens.tolist() == [0, 4, 8, 18, 28, 38, 46, 54, 62, 70, 78]
    assert batch.positions[8:].tolist() == [*range(10)] * 3 + [*range(8)] * 5
    assert batch.labels[8:].tolist() == [X] * 70 and batch.input_ids[8:].tolist() == [PAD] * 70
    assert not batch.spans.counted[8:].any()


def test_hand_built_pad_samples():
    batch = pad_samples(_two_samples(), PAD)
    assert batch.input_ids.tolist() == [[11, 12, 13, 14], [21, 22, 23, PAD]]
    assert batch.labels.tolist() == [[X, 13, 14, X], [22, 23, X, X]]
    assert batch.spans.pad_mask.tolist() == [[True] * 4, [True, True, True, False]]
    assert batch.spans.pad_mask.dtype == torch.bool and not batch.spans.packed
    assert batch.positions[0].tolist() == [0, 1, 2, 3] and batch.positions[1, :3].tolist() == [0, 1, 2]
    assert batch.num_supervised == 4


def test_hand_built_pad_samples_multiple_of():
    batch = pad_samples(_two_samples(), PAD, multiple_of=8)
    assert batch.input_ids.shape == (2, 8)
    assert batch.input_ids.tolist() == [[11, 12, 13, 14] + [PAD] * 4, [21, 22, 23] + [PAD] * 5]
    assert batch.labels.tolist() == [[X, 13, 14, X] + [X] * 4, [22, 23, X] + [X] * 5]
    assert batch.spans.pad_mask.tolist() == [[True] * 4 + [False] * 4, [True] * 3 + [False] * 5]
    assert batch.positions[0, :4].tolist() == [0, 1, 2, 3] and batch.positions[1, :3].tolist() == [0, 1, 2]


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("multiple_of", [1, 2, 4, 8])
def test_pack_matches_reference(multiple_of):
    g = torch.Generator().manual_seed(multiple_of)
    samples = _random_text_samples([1, 7, 2, 13, 8, 3, 16, 5], g)
    batch = pack_samples(samples, PAD, multiple_of=multiple_of)
    ids, labels, positions, cu = reference_pack(samples, PAD, multiple_of)
    assert batch.input_ids.tolist() == ids
    assert batch.labels.tolist() == labels
    assert batch.positions.tolist() == positions
    assert batch.spans.cu_seqlens.tolist() == cu
    seg = [b - a for a, b in zip(cu[:-1], cu[1:])]
    assert all(n % multiple_of == 0 for n in seg)  # every sample's segment, padding included
    assert batch.spans.max_seqlen == max(seg)
    assert packed_length(samples, multiple_of) == len(ids)


@pytest.mark.parametrize("multiple_of", [1, 2, 4, 8])
def test_pack_invariants_per_segment(multiple_of):
    """Each invariant, checked segment by segment from the outputs alone."""
    g = torch.Generator().manual_seed(10 + multiple_of)
    samples = _random_text_samples([5, 1, 9, 4, 12], g)
    batch = pack_samples(samples, PAD, multiple_of=multiple_of)
    cu = batch.spans.cu_seqlens.tolist()
    assert len(cu) == len(samples) + 1 and cu[0] == 0 and cu[-1] == batch.input_ids.numel()
    for k, s in enumerate(samples):
        a, b = cu[k], cu[k + 1]
        n = len(s)
        assert b - a == _ceil_to(n, multiple_of)
        assert batch.positions[a:b].tolist() == list(range(b - a))  # restart at 0
        assert batch.input_ids[a : a + n].tolist() == s.tokens
        assert (batch.input_ids[a + n : b] == PAD).all()
        lab = batch.labels[a:b].tolist()
        assert lab[n - 1] == X  # last token predicts nothing: no label crosses into the next sample
        assert all(v == X for v in lab[n:])  # padding predicts nothing
        for i in range(n - 1):
            assert lab[i] == (s.tokens[i + 1] if s.supervised[i + 1] else X)


def test_pack_mixed_samples_matches_reference(mixed_samples, tok):
    batch = pack_samples(mixed_samples, tok.pad_id, multiple_of=4)
    ids, labels, positions, cu = reference_pack(mixed_samples, tok.pad_id, 4)
    assert batch.input_ids.tolist() == ids
    assert batch.labels.tolist() == labels
    assert batch.positions.tolist() == positions
    assert batch.spans.cu_seqlens.tolist() == cu


def test_labels_ignore_prompt_and_placeholders(mixed_samples, tok):
    """No label is ever <bos>, a placeholder, a prompt byte or padding; supervised targets are exactly
    the answer tokens that follow another token of the same sample."""
    batch = pack_samples(mixed_samples, tok.pad_id, multiple_of=2)
    labels, ids = batch.labels.tolist(), batch.input_ids.tolist()
    forbidden = {tok.bos_id, tok.pad_id, *tok.placeholder_ids.values()}
    assert not forbidden & set(labels)
    for i in range(len(ids) - 1):
        if ids[i + 1] in forbidden:
            assert labels[i] == X
    expected = sum(sum(s.supervised[1:]) for s in mixed_samples)
    assert batch.num_supervised == expected
    # every supervised token of every sample is somebody's label, in order
    want = [t for s in mixed_samples for t, sup in zip(s.tokens[1:], s.supervised[1:]) if sup]
    assert [v for v in labels if v != X] == want


def test_sample_of_length_one():
    one = text_sample([42], n_prompt=0)  # even a supervised single token has nothing to predict
    other = text_sample([1, 2, 3], n_prompt=1)
    batch = pack_samples([other, one, other], PAD)
    assert batch.input_ids.tolist() == [1, 2, 3, 42, 1, 2, 3]
    assert batch.labels.tolist() == [2, 3, X, X, 2, 3, X]
    assert batch.positions.tolist() == [0, 1, 2, 0, 0, 1, 2]
    assert batch.spans.cu_seqlens.tolist() == [0, 3, 4, 7]
    batch = pack_samples([one], PAD, multiple_of=4)
    assert batch.input_ids.tolist() == [42, PAD, PAD, PAD]
    assert batch.labels.tolist() == [X] * 4
    assert batch.spans.cu_seqlens.tolist() == [0, 4]


@pytest.mark.parametrize("multiple_of", [1, 2, 4])
def test_pack_exactly_full_has_no_filler(multiple_of):
    g = torch.Generator().manual_seed(3)
    samples = _random_text_samples([3, 6, 5], g)
    total = sum(_ceil_to(len(s), multiple_of) for s in samples)
    batch = pack_samples(samples, PAD, multiple_of=multiple_of, pack_len=total)
    ids, labels, positions, cu = reference_pack(samples, PAD, multiple_of)
    assert len(cu) == len(samples) + 1  # no extra segment
    assert batch.spans.cu_seqlens.tolist() == cu
    assert batch.input_ids.tolist() == ids and batch.labels.tolist() == labels
    assert batch.positions.tolist() == positions


@pytest.mark.parametrize("multiple_of", [1, 2, 8])
def test_pack_with_filler(multiple_of):
    g = torch.Generator().manual_seed(4)
    samples = _random_text_samples([3, 6, 5], g)
    total = sum(_ceil_to(len(s), multiple_of) for s in samples)
    pack_len = total + 3 * multiple_of
    batch = pack_samples(samples, PAD, multiple_of=multiple_of, pack_len=pack_len)
    ids, labels, positions, cu = reference_pack(samples, PAD, multiple_of, pack_len)
    assert batch.input_ids.numel() == pack_len
    assert batch.spans.cu_seqlens.tolist() == cu
    assert cu[-4] == total and cu[-1] == pack_len  # filler: 3 segments of one multiple each
    assert batch.input_ids.tolist() == ids and batch.labels.tolist() == labels
    assert batch.positions.tolist() == positions
    assert (batch.labels[total:] == X).all() and (batch.input_ids[total:] == PAD).all()


def test_overflow_error_names_the_numbers():
    samples = [text_sample([1, 2, 3], 1), text_sample([4, 5, 6, 7, 8], 1)]  # 3 + 5 → 4 + 8 = 12 with m=4
    with pytest.raises(ValueError) as e:
        pack_samples(samples, PAD, multiple_of=4, pack_len=8)
    msg = str(e.value)
    assert "2 samples" in msg and "12" in msg and "8" in msg and "4" in msg


def test_pack_len_not_a_multiple():
    samples = [text_sample([1, 2, 3], 1)]
    with pytest.raises(ValueError, match=r"pack_len=10 is not a multiple of 4"):
        pack_samples(samples, PAD, multiple_of=4, pack_len=10)


def test_empty_inputs_are_errors():
    with pytest.raises(ValueError, match="no samples"):
        pack_samples([], PAD)
    with pytest.raises(ValueError, match="no samples"):
        pad_samples([], PAD)
    with pytest.raises(ValueError, match="no tokens"):
        pack_samples([text_sample([1, 2], 1), text_sample([], 0)], PAD)


# ---------------------------------------------------------------- padded collation


@pytest.mark.parametrize("multiple_of", [1, 2, 4, 8])
def test_pad_samples_matches_reference(multiple_of):
    g = torch.Generator().manual_seed(20 + multiple_of)
    samples = _random_text_samples([4, 1, 11, 6], g)
    batch = pad_samples(samples, PAD, multiple_of=multiple_of)
    seq = _ceil_to(max(len(s) for s in samples), multiple_of)
    assert batch.input_ids.shape == batch.labels.shape == batch.positions.shape == (len(samples), seq)
    assert batch.spans.pad_mask.shape == (len(samples), seq)
    for row, s in enumerate(samples):
        # each row, once its padding is cut, is exactly that sample packed alone
        ids, labels, positions, _ = reference_pack([s], PAD)
        n = len(s)
        assert batch.input_ids[row].tolist() == ids + [PAD] * (seq - n)
        assert batch.labels[row].tolist() == labels + [X] * (seq - n)
        assert batch.positions[row, :n].tolist() == positions
        assert batch.spans.pad_mask[row].tolist() == [True] * n + [False] * (seq - n)


# ---------------------------------------------------------------- modality inputs


def _runs(ids: list[int], token: int) -> list[int]:
    """Lengths of the maximal runs of `token` in ids."""
    out, n = [], 0
    for t in ids + [None]:
        if t == token:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


@pytest.mark.parametrize("collate", ["pack", "pad"])
def test_modality_inputs_in_placeholder_order(collate, tiny_model, tok):
    g = torch.Generator().manual_seed(5)
    # sizes chosen so every item has a different token count: the order is then visible in the ids
    specs = [
        Spec(images=[(8, 4)], audio=[3]),
        Spec(),
        Spec(images=[(4, 12), (16, 8)], audio=[9, 21]),
        Spec(audio=[13]),
        Spec(images=[(12, 16)]),
    ]
    samples = [make_sample(s, tiny_model, tok, g) for s in specs]
    batch = pack_samples(samples, tok.pad_id, multiple_of=4) if collate == "pack" else pad_samples(samples, tok.pad_id)
    want_images = [img for s in samples for img in s.images]
    want_audio = [clip for s in samples for clip in s.audio]
    assert len(batch.modality_inputs["vision"]) == 4 and len(batch.modality_inputs["audio"]) == 4
    assert all(a is b for a, b in zip(batch.modality_inputs["vision"], want_images, strict=True))
    assert all(a is b for a, b in zip(batch.modality_inputs["audio"], want_audio, strict=True))
    # the placeholder runs in the flattened ids (sample after sample) have the sizes of the items, in order
    ids = batch.input_ids.flatten().tolist()
    # (one sample's items of one modality sit side by side, so compare per-sample totals in sample order)
    vision_per_sample = [sum((h // 4) * (w // 4) for h, w in s.images) for s in specs if s.images]
    assert vision_per_sample == [2, 3 + 8, 12]
    assert _runs(ids, tok.placeholder_ids["vision"]) == vision_per_sample
    audio_per_sample = [sum((n + 1) // 2 for n in s.audio) for s in specs if s.audio]
    assert audio_per_sample == [2, 5 + 11, 7]
    assert _runs(ids, tok.placeholder_ids["audio"]) == audio_per_sample


def test_mixed_specs_cover_what_the_other_tests_need(mixed_samples):
    """Guards the shared fixture: different image sizes, different clip lengths, a length-1 sample."""
    sizes = {tuple(img.shape[1:]) for s in mixed_samples for img in s.images}
    frames = {clip.shape[1] for s in mixed_samples for clip in s.audio}
    assert len(sizes) >= 3 and len(frames) >= 3
    assert min(len(s) for s in mixed_samples) == 1
    assert len(MIXED_SPECS) == len(mixed_samples)


def test_batch_to_keeps_everything(mixed_samples, tok):
    batch = pack_samples(mixed_samples, tok.pad_id, multiple_of=2)
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and torch.equal(moved.labels, batch.labels)
    assert torch.equal(moved.positions, batch.positions)
    assert torch.equal(moved.spans.cu_seqlens, batch.spans.cu_seqlens)
    assert moved.spans.max_seqlen == batch.spans.max_seqlen
    assert [t.shape for t in moved.modality_inputs["vision"]] == [t.shape for t in batch.modality_inputs["vision"]]
