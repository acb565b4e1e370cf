"""Instruction data: a row of a corpus as the pieces the loss counts and the ones it does not.

| row | pieces (loss counted: ✓) |
|---|---|
| `{"text": "..."}` (or `--field`) | the text ✓ |
| `{"prompt": "...", "completion": "..."}` | the prompt, the completion ✓ |
| `{"messages": [{"role": ..., "content": ...}, ...]}` | the chat by the tokenizer's template (*) |

(*) each assistant turn's content ✓; every other part (system, user, the template's headers) not.

A chat is cut by rendering the template on longer and longer prefixes of its messages: what an
assistant message adds after the template's generation prompt is that turn's text. The
end-of-sequence token that follows a document is a target the loss counts when the document's
last piece is, so a model learns where its answers end.
"""

from __future__ import annotations

from collections.abc import Iterator

from brigade.data.piece import Piece
from brigade.errors import BrigadeError


class Chat:
    """The chat template of a model directory (`tokenizer_config.json` or `chat_template.jinja`,
    as `save_pretrained` writes them), through `transformers`, read on first use (a corpus
    without chats never needs it)."""

    def __init__(self, directory: str):
        self.directory, self._tokenizer = directory, None

    def _load(self):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise BrigadeError("chat data ('messages') needs the 'transformers' package: "
                               "pip install -e '.[hf]'") from None
        tokenizer = AutoTokenizer.from_pretrained(self.directory)
        if not getattr(tokenizer, "chat_template", None):
            raise BrigadeError(f"{self.directory!r} has no chat template, so rows with 'messages' "
                               "cannot be written as text: save a tokenizer that has one, or give "
                               "'prompt' and 'completion' instead")
        return tokenizer

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        if self._tokenizer is None:
            self._tokenizer = self._load()
        return self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=generation_prompt)

    def pieces(self, messages: list[dict], where: str) -> Iterator[Piece]:
        """The chat's pieces: the assistant turns' contents counted, the rest not."""
        done = ""
        for k, message in enumerate(messages):
            if message.get("role") == "assistant":
                prompt = self.render(messages[:k], generation_prompt=True)
                yield from _piece(prompt, done, False, where)
                done = prompt
            text = self.render(messages[: k + 1])
            yield from _piece(text, done, message.get("role") == "assistant", where)
            done = text


def _piece(text: str, done: str, loss: bool, where: str) -> Iterator[Piece]:
    if not text.startswith(done):
        raise BrigadeError(f"{where}: the chat template writes a conversation's start differently "
                           "once it goes on, so its turns cannot be told apart: give 'prompt' and "
                           "'completion' instead")
    if text[len(done):]:
        yield Piece(text[len(done):], loss=loss, starts_document=not done)


def row_pieces(row: dict, field: str, where: str, chat: Chat | None) -> Iterator[Piece]:
    """The pieces of one row (see the module's table); an empty text is left out.

    Raises:
        BrigadeError: a row with neither a string `field`, nor `messages`, nor `prompt` and
            `completion`; `messages` that are not a list of role/content objects.
    """
    value = row.get(field)
    if isinstance(value, str):
        if value:
            yield Piece(value)
    elif isinstance(row.get("messages"), list):
        if chat is None:
            raise BrigadeError(f"{where} has 'messages': chat data needs the model directory's "
                               "chat template")
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in row["messages"]):
            raise BrigadeError(f"{where}: each of 'messages' must be like "
                               '{"role": "user", "content": "..."}')
        yield from chat.pieces(row["messages"], where)
    elif isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        yield Piece(row["prompt"], loss=False)
        yield Piece(row["completion"], loss=True, starts_document=False)
    else:
        raise BrigadeError(f"{where} has no string field {field!r} (nor 'messages', nor 'prompt' "
                           f"and 'completion'): give rows like {{\"{field}\": \"...\"}}")
