"""Chat templates rendered as transformers renders them, without importing transformers.

Importing transformers' template code costs a worker ~28 MB (``transformers.utils`` and what it
pulls in) and its tokenizer wrapper ~20 MB more; the gateway only needs the rendered text. This
module builds the same Jinja environment that ``transformers.utils.chat_template_utils`` documents
and uses (sandboxed and immutable, ``trim_blocks``/``lstrip_blocks``, loop controls, a
``{% generation %}`` block, a ``tojson`` that does not escape HTML, ``raise_exception`` and
``strftime_now``) and applies ``apply_chat_template``'s rules for ``tokenize=False``: special tokens
as template variables, named templates, ``continue_final_message``. transformers stays the
reference: ``tests/gateway/test_templates.py`` renders the same conversations through both, and
every load checks the model's own templates against what transformers rendered for them
(``gateway/tokenization/bundle.py``).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.nodes

from engine_model import chat_env

# transformers marks where the final message's text ends with this tag, then cuts there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_COMPILED_MAX = 16  # templates kept compiled: the model's own few, and trusted request templates


class TemplateRenderer:
    """Compiles and renders chat templates; keeps the last ``_COMPILED_MAX`` compiled."""

    def __init__(self) -> None:
        self._env = chat_env.environment()
        self._compiled: OrderedDict[str, jinja2.Template] = OrderedDict()

    def parse(self, template: str) -> jinja2.nodes.Template:
        """The template's syntax tree (its variables, its content format), as this environment reads it."""
        return self._env.parse(template)

    def compiled(self, template: str) -> jinja2.Template:
        found = self._compiled.get(template)
        if found is None:
            found = self._env.from_string(template)
            self._compiled[template] = found
            if len(self._compiled) > _COMPILED_MAX:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(template)
        return found

    def render(
        self,
        template: str,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """One conversation's text, as ``apply_chat_template(..., tokenize=False)`` returns it."""
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
                "when you want the model to continue the final message, and add_generation_prompt when you want "
                "to add a header that will prompt it to start a new assistant message instead."
            )
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ValueError(
                "Tools should either be a JSON schema, or a callable function with type hints "
                "and a docstring suitable for auto-conversion to a schema."
            )
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        compiled = self.compiled(template)
        final = None
        if continue_final_message:
            messages, final = _mark_final(messages, template, continue_final_message)
        text: str = compiled.render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **(variables or {}),
        )
        return text if final is None else _cut_at_mark(text, final)


def _mark_final(messages: list[dict[str, Any]], template: str, key: bool | str) -> tuple[list[dict[str, Any]], str]:
    """A copy of the messages whose final text ends with the tag, and that text."""
    field = key if isinstance(key, str) else "content"
    messages = copy.deepcopy(messages)
    final = messages[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    if field not in template:
        raise ValueError(
            f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template'
        )
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                break
        else:
            raise ValueError(
                "continue_final_message is set but we could not find any text to continue in the final message!"
            )
    else:
        messages[-1][field] = final + _CONTINUE_TAG
    return messages, final


def _cut_at_mark(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after "
            "applying the chat template! This can happen if the chat template deletes portions of "
            "the final message. Please verify the chat template and final message in your chat to "
            "ensure they are compatible."
            f"Final message to continue: {final.strip()}\nRendered chat:\n{text}"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]  # the template kept the spacing
    return text[:at].rstrip()  # it trimmed the message's trailing space


def select(templates: str | dict[str, str] | None, given: str | None, tools: Any) -> str:
    """The template ``apply_chat_template`` uses: a named one of the model's, the given text, the
    model's ``tool_use`` one when there are tools, its ``default`` one, or its only one."""
    if isinstance(templates, dict):
        if given is not None and given in templates:
            return templates[given]
        if given is None:
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(
                "This model has multiple chat templates with no default specified! Please either pass a chat "
                "template or the name of the template you wish to use to the `chat_template` argument. Available "
                f"template names are {sorted(templates.keys())}."
            )
        return given
    if given is not None:
        return given
    if templates is None:
        raise ValueError(
            "Cannot use chat template functions because tokenizer.chat_template is not set and no template "
            "argument was passed! For information about writing templates and setting the "
            "tokenizer.chat_template attribute, please see the documentation at "
            "https://huggingface.co/docs/transformers/main/en/chat_templating"
        )
    return templates
