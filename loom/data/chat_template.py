"""A tokenizer folder's chat template: where it is read from, compiled as transformers compiles it, and whether it
reads each message's content as parts.

The template is a processor's `chat_template.json` (LLaVA's folders keep the one that writes images there, beside a
text-only one in the tokenizer's files), else `tokenizer_config.json`'s `chat_template`, else
`chat_template.jinja`. It is text from the folder, so it runs in jinja2's immutable sandbox, with transformers'
`{% generation %}` tag (it marks assistant text for transformers; loom finds the assistant's text by rendering turn
by turn, so the tag renders its body unchanged). A processor's rendered text is tokenised as the processor
tokenises it: with the tokenizer's own special tokens (Llama's <s>), unless the text already starts with bos.

Content: a template that asks each part's `type` (LLaVA's and Qwen2-VL's iterate over `message['content']`) is given
the parts as transformers' processors pass them — `{"type": "text", "text": …}`, `{"type": "image"}`,
`{"type": "audio"}` — and writes each media item's placeholder itself; any other template gets one string with the
placeholders in place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

# a template that asks a content part's type: `['type']`, `.type`, `selectattr('type', …)`
READS_PARTS = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b|selectattr\(\s*['"]type['"]""")


class GenerationTag(Extension):
    """transformers' `{% generation %}…{% endgeneration %}`: here it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def template_source(folder: Path, config: dict) -> tuple[str, bool]:
    """The folder's chat template text, and whether it is a processor's (chat_template.json); a ValueError naming
    the places looked at when there is none."""
    template = None
    if (folder / "chat_template.json").is_file():
        template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    if template:
        return template, True
    template = config.get("chat_template")
    if not template and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if not isinstance(template, str) or not template:
        raise ValueError(f"{folder}: no chat template (chat_template.json, tokenizer_config.json \"chat_template\" "
                         f"or chat_template.jinja); loom renders conversations with it")
    return template, False


def environment() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag])
