"""`tandem chat`: a conversation with a model in the terminal.

Each turn renders the whole conversation with the model's chat template and streams the reply as
the engine produces it; the conversation is kept until /reset. When it no longer fits the model's
context with room for a reply, its oldest exchanges are dropped (said once per turn). Ctrl-C stops
a reply half-way (the part shown stays in the conversation); at the prompt it clears the line.
/exit (or Ctrl-D) leaves.
"""

from __future__ import annotations

import itertools
import signal
import sys
from collections.abc import Callable
from typing import Any, TextIO

from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams

PROMPT = ">>> "
HELP = "/reset: start a new conversation   /exit (or Ctrl-D): leave   Ctrl-C: stop a reply"
EXIT_COMMANDS = ("/exit", "/quit", "/bye")


class Chat:
    """One terminal conversation over an engine (the engine runs in this process)."""

    def __init__(
        self,
        engine: LLMEngine,
        params: SamplingParams,
        system: str | None = None,
        chat_template: str | None = None,
        out: TextIO = sys.stdout,
    ) -> None:
        self.engine = engine
        self.params = params
        self.system = system
        self.chat_template = chat_template
        self.out = out
        self.history: list[dict[str, Any]] = []
        self._ids = itertools.count()
        self._stop = False
        # The reply must fit beside the prompt: prompt + max_tokens within max_model_len.
        self.max_prompt = engine.core.limits.max_model_len - (params.max_tokens or 0)
        if self.max_prompt < 1:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) leaves no room for a prompt in max_model_len "
                f"({engine.core.limits.max_model_len})"
            )
        # Fails now, not at the first message, for a model without a chat template.
        self._render([{"role": "user", "content": "hi"}])

    def _render(self, history: list[dict[str, Any]]) -> list[int]:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + history
        return self.engine.tokenizer.apply_chat_template(messages, chat_template=self.chat_template)

    def prompt_ids(self) -> list[int] | None:
        """The conversation's prompt, its oldest exchanges dropped until it fits; None if even the
        last message alone does not."""
        dropped = 0
        while self.history:
            ids = self._render(self.history)
            if len(ids) <= self.max_prompt:
                if dropped:
                    self.out.write(f"(the {dropped} oldest messages no longer fit the context: left out)\n")
                return ids
            self.history.pop(0)
            dropped += 1
        return None

    def command(self, text: str) -> bool | None:
        """Handle a /command: True to go on, False to leave, None when `text` is a message."""
        word = text.split()[0].lower()
        if word in EXIT_COMMANDS:
            return False
        if word == "/reset":
            self.history.clear()
            self.out.write("(new conversation)\n")
            return True
        if word in ("/help", "/?"):
            self.out.write(HELP + "\n")
            return True
        if word.startswith("/") and len(word) > 1 and word[1:].isalpha():
            self.out.write(f"unknown command {word}; {HELP}\n")
            return True
        return None

    def reply(self, text: str) -> str:
        """Send a user message and stream the model's answer; the answer (or its part before Ctrl-C)."""
        self.history.append({"role": "user", "content": text})
        ids = self.prompt_ids()
        if ids is None:
            self.out.write(
                f"(that message is longer than the model's context allows: {self.max_prompt} tokens)\n"
            )
            return ""
        request_id = f"chat-{next(self._ids)}"
        self.engine.add_request(request_id, {"prompt_token_ids": ids}, self.params)
        shown = ""
        self._stop = False
        previous = signal.signal(signal.SIGINT, self._interrupt)
        try:
            while self.engine.has_unfinished_requests():
                if self._stop:
                    self.engine.abort_request(request_id)
                    self.out.write(" [stopped]")
                    break
                for out in self.engine.step():
                    text_so_far = out.outputs[0].text
                    self.out.write(text_so_far[len(shown) :])
                    self.out.flush()
                    shown = text_so_far
        finally:
            signal.signal(signal.SIGINT, previous)
        self.out.write("\n")
        self.history.append({"role": "assistant", "content": shown})
        return shown

    def _interrupt(self, signum: int, frame: Any) -> None:
        # Stop between engine steps: an exception raised inside one would leave it half done.
        self._stop = True

    def run(self, read: Callable[[str], str] = input) -> int:
        while True:
            try:
                line = read(PROMPT)
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\n")
                continue
            text = line.strip()
            if not text:
                continue
            handled = self.command(text)
            if handled is False:
                return 0
            if handled is None:
                self.reply(text)


def run_chat(
    engine: LLMEngine, params: SamplingParams, name: str, system: str | None, chat_template: str | None
) -> int:
    chat = Chat(engine, params, system, chat_template)
    if sys.stdin.isatty():
        import readline  # noqa: F401 - line editing and history for input()
    sys.stdout.write(f"tandem chat with {name}. {HELP}\n")
    sys.stdout.flush()
    return chat.run()
