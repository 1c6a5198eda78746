"""Role turns rendered through the model's chat template (ARCHITECTURE §11).

Invariant: after every closed turn, the conversation part of a program's text equals
`tokenizer.apply_chat_template(messages, tokenize=False)` for the messages so far.

A turn's opening text is found by rendering the messages so far plus a placeholder message of
that role and cutting at the placeholder; the closing text is what the template adds after the
content once the turn is closed. Both are appended to the existing text, so a later prompt
extends an earlier one and hits the prefix cache. Where a template rewrites earlier turns (the
extended rendering does not start with the shorter one: e.g. it trims content or drops reasoning
from past turns), the conversation is re-rendered from the messages instead and the loss of prefix
reuse is logged once per template.
"""
from __future__ import annotations

import copy
import logging
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

# Private-use code points: no template trims, escapes or otherwise transforms them.
PLACEHOLDER = "\ue000radixserve-turn-content\ue001"

RenderFn = Callable[[list[dict[str, Any]], bool], str]


class ChatTemplate:
    """A model's chat template as a function of (messages, add_generation_prompt) -> text."""

    def __init__(self, render: RenderFn, name: str = "chat template") -> None:
        self._render = render
        self.name = name
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, name: str | None = None) -> "ChatTemplate":
        """Wrap anything with transformers' `apply_chat_template(messages, tokenize=False, ...)`."""
        if getattr(tokenizer, "chat_template", "present") is None:
            raise ValueError(f"the tokenizer of {name or 'this model'} has no chat template; "
                             "use plain text (s += '...') instead of system/user/assistant turns")

        def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)

        return cls(render, name or getattr(tokenizer, "name_or_path", "chat template"))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        try:
            return self._render(messages, add_generation_prompt)
        except Exception as exc:  # jinja raises its own exception types (e.g. "roles must alternate")
            roles = [m["role"] for m in messages]
            raise ValueError(f"the chat template of {self.name} rejects the turns {roles}: {exc}") from exc

    def warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.warning("%s: %s", self.name, message)


class Conversation:
    """The messages of one program state and the template text its turns were built from."""

    def __init__(self, template: ChatTemplate | None) -> None:
        self.template = template
        self.messages: list[dict[str, str]] = []
        self.open_role: str | None = None
        self._rendered = ""  # template text of the closed turns (plus the open turn's head)
        self._conv_start: int | None = None  # where the conversation starts in the program text
        self._content_start = 0

    def copy(self) -> "Conversation":
        twin = copy.copy(self)
        twin.messages = [dict(m) for m in self.messages]
        return twin

    def begin(self, role: str, text: str) -> str:
        """Open a turn; returns the program text with the turn's opening appended."""
        template = self._need_template(role)
        if self.open_role is not None:
            raise ValueError(f"cannot open a {role} turn inside an open {self.open_role} turn")
        if self._conv_start is None:
            self._conv_start = len(text)
        full = template.render(self.messages + [{"role": role, "content": PLACEHOLDER}])
        cut = full.find(PLACEHOLDER)
        if cut < 0:
            raise ValueError(f"the chat template of {template.name} drops the content of {role} turns")
        head = full[:cut]
        text = self._extend(text, head, "opening a turn changes the text of earlier turns")
        self.open_role = role
        self._content_start = len(text)
        return text

    def end(self, role: str, text: str) -> str:
        """Close the open turn; returns the program text with the turn's closing appended."""
        template = self._need_template(role)
        if self.open_role != role:
            raise ValueError(f"cannot close a {role} turn: the open turn is {self.open_role or 'none'}")
        content = text[self._content_start:]
        self.messages.append({"role": role, "content": content})
        self.open_role = None
        full = template.render(self.messages)
        return self._extend(text, full, "the template rewrites a closed turn (e.g. trims its content)",
                            known=self._rendered + content)

    def _extend(self, text: str, full: str, why: str, known: str | None = None) -> str:
        """Append what `full` adds to the text rendered so far, or re-render if it rewrote it."""
        known = self._rendered if known is None else known
        if full.startswith(known):
            self._rendered = full
            return text + full[len(known):]
        self.template.warn_once(why, f"{why}; re-rendering the conversation, so later prompts reuse "
                                     "less of the prefix cache")
        self._rendered = full
        # Plain text added between turns (outside any role) is dropped by the re-render.
        return text[:self._conv_start] + full

    def _need_template(self, role: str) -> ChatTemplate:
        if self.template is None:
            raise ValueError(f"a {role} turn needs a chat template, and this backend has none; "
                             "use plain text (s += '...') instead")
        return self.template
