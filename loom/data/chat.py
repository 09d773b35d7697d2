"""A Hugging Face tokenizer folder and its chat template turning a Conversation into training tokens.

The folder holds `tokenizer.json` (read with `tokenizers`) and the chat template (chat_template.py: where it is
read from, the sandbox it renders in).

Media: each image or clip is written into its turn's text as the modality's placeholder token (e.g.
`<|image_pad|>`) — by the template itself where it reads content parts (chat_template.py) — then the one
placeholder becomes as many as the encoder emits rows for that item. A placeholder missing from the vocabulary
is added (`added`: the model's embedding must grow by as many rows).

Loss mask: only assistant turns are targets. Each assistant turn's text is found by rendering the
conversation up to it twice — with the generation prompt before it, and with it — so the difference is
exactly what the model must produce: its content up to and including its last end-of-turn (eos) token, so
generation stops where the target ends; a token is supervised when its characters lie inside such a span.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from tokenizers import AddedToken, Tokenizer

from loom.data.chat_template import READS_PARTS, environment, template_source
from loom.data.conversations import MODULE_OF, BadSample, Conversation

PLACEHOLDERS = {"vision": "<|image_pad|>", "audio": "<|audio_pad|>"}  # encoder → its placeholder token


def _token_text(value) -> str:
    """bos/eos in tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    return value.get("content", "") if isinstance(value, dict) else (value or "")


class ChatTokenizer:
    def __init__(self, folder: str | Path, placeholders: dict[str, str] | None = None) -> None:
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder}: no tokenizer.json (a Hugging Face fast-tokenizer folder)")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template, self.processor_template = template_source(folder, config)
        env = environment()  # transformers' settings
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template)
        self.reads_parts = bool(READS_PARTS.search(template))
        self.specials = {"bos_token": _token_text(config.get("bos_token")),
                         "eos_token": _token_text(config.get("eos_token"))}
        self.placeholders = dict(PLACEHOLDERS if placeholders is None else placeholders)
        missing = [t for t in self.placeholders.values() if self.tokenizer.token_to_id(t) is None]
        if missing:
            self.tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        self.added = missing  # new vocabulary entries: the LLM's embedding grows by len(added) rows
        self.placeholder_ids = {module: self.tokenizer.token_to_id(t) for module, t in self.placeholders.items()}
        self.eos_id = self._id(folder, self.specials["eos_token"], "eos_token")  # ends an assistant turn
        pad = _token_text(config.get("pad_token"))
        self.pad_id = self._id(folder, pad, "pad_token") if pad else self.eos_id  # fills only unlabelled slots

    def _id(self, folder: Path, text: str, key: str) -> int:
        token = self.tokenizer.token_to_id(text) if text else None
        if token is None:
            raise ValueError(f"{folder}/tokenizer_config.json: {key} {text!r} is not a token of tokenizer.json")
        return token

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, up to the end-of-turn token, special tokens skipped (a reward reads it)."""
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **self.specials)

    def _render(self, conv: Conversation, messages: list[dict], add_generation_prompt: bool) -> str:
        """render(), a template that refuses the conversation (raise_exception, a jinja error) a BadSample."""
        try:
            return self.render(messages, add_generation_prompt)
        except BadSample:
            raise
        except (TemplateError, ValueError, TypeError) as e:
            raise BadSample(f"{conv.where}: the chat template refuses this conversation ({e})") from None

    def messages(self, conv: Conversation) -> list[dict]:
        """The conversation as the template reads it: each turn's parts (chat_template.py), or its text with media
        as placeholder tokens."""
        if self.reads_parts:
            return [{"role": t.role, "content": [{"type": "text", "text": p.text} if p.kind == "text" else
                                                 {"type": p.kind} for p in t.parts]} for t in conv.turns]

        def text(p) -> str:
            return p.text if p.kind == "text" else self.placeholders[MODULE_OF[p.kind]]

        return [{"role": t.role, "content": "".join(map(text, t.parts))} for t in conv.turns]

    def encode(self, conv: Conversation, rows: dict[str, list[int]], train_on: str = "assistant"
               ) -> tuple[list[int], list[bool]]:
        """Token ids and which are targets (the assistant turns', or with `train_on` = "all" every text
        token); `rows[module][i]`: how many rows that encoder emits for its i-th item of the conversation, each
        item's placeholder repeated that many times."""
        messages = self.messages(conv)
        text = self._render(conv, messages, add_generation_prompt=False)
        spans = []
        for k, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            before = self._render(conv, messages[:k], add_generation_prompt=True)
            upto = self._render(conv, messages[: k + 1], add_generation_prompt=False)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise BadSample(f"{conv.where}: the chat template does not render this conversation turn by "
                                f"turn (turn {k} changes the text before it), so the assistant's tokens cannot "
                                f"be told apart")
            end = upto.rfind(self.specials["eos_token"], len(before)) if self.specials["eos_token"] else -1
            # the turn's target ends with its end-of-turn token (where generation stops), not the newline after it
            spans.append((len(before), end + len(self.specials["eos_token"]) if end >= 0 else len(upto)))
        inside = lambda a, b: train_on == "all" or any(s <= a and b <= e for s, e in spans)  # noqa: E731
        return self._tokens(conv, text, rows, inside)

    def encode_prompt(self, conv: Conversation, rows: dict[str, list[int]]) -> list[int]:
        """A prompt's token ids (no targets), ending with the template's generation prompt: where a sampler
        starts the assistant's answer."""
        text = self._render(conv, self.messages(conv), add_generation_prompt=True)
        return self._tokens(conv, text, rows, lambda a, b: False)[0]

    def _tokens(self, conv: Conversation, text: str, rows: dict[str, list[int]], is_target
                ) -> tuple[list[int], list[bool]]:
        """`text` tokenised, each media placeholder repeated as many times as its item's rows; a text token
        whose characters [a, b) satisfy `is_target(a, b)` is a target."""
        # a processor's template: its text tokenised as the processor does (chat_template.py)
        bos = self.specials["bos_token"]
        specials = self.processor_template and not (bos and text.startswith(bos))
        encoding = self.tokenizer.encode(text, add_special_tokens=specials)
        ids, targets = [], []
        taken = dict.fromkeys(rows, 0)
        module_of = {i: module for module, i in self.placeholder_ids.items()}
        for token, (start, end) in zip(encoding.ids, encoding.offsets):
            module = module_of.get(token)
            if module is not None:
                if taken.get(module, 0) >= len(rows.get(module, [])):
                    raise BadSample(f"{conv.where}: more {self.placeholders[module]} placeholders than {module} "
                                    f"items (a placeholder typed into the text?)")
                n = rows[module][taken[module]]
                taken[module] += 1
                ids += [token] * n
                targets += [False] * n
                continue
            ids.append(token)
            targets.append(end > start and is_target(start, end))
        unused = {k: len(v) - taken.get(k, 0) for k, v in rows.items() if len(v) != taken.get(k, 0)}
        if unused:
            raise BadSample(f"{conv.where}: {unused} media items have no placeholder in the rendered text")
        return ids, targets


def _raise(message: str):
    raise ValueError(f"chat template: {message}")
