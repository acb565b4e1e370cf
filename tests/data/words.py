"""A word-level tokenizer with known ids, and corpus files, for the data tests."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, models, pre_tokenizers, processors

WORDS = ["</s>", "<s>", "[UNK]", "a", "b", "c", "d", "e", "f", "g", "h"]
ID = {w: i for i, w in enumerate(WORDS)}  # "</s>" is 0, "a" is 3, ... "h" is 10
# A chat template in the ChatML manner, the words above for its markers.
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<s> ' + m['role'] + ' ' + m['content'] + ' </s> ' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<s> assistant ' }}{% endif %}")


def save_tokenizer(directory, words=WORDS, chat: bool = False):
    """A word-level tokenizer; its post-processor wraps a text in <s> ... </s>, which the data
    must leave out (add_special_tokens=False). `chat`: with a chat template (roles as words)."""
    words = list(words) + (["system", "user", "assistant"] if chat else [])
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if "</s>" in words:
        tok.add_special_tokens(["</s>", "<s>"])
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 0)])
    directory.mkdir(exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if chat:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
                  "eos_token": "</s>", "bos_token": "<s>", "unk_token": "[UNK]"}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory)


def ids(words: str) -> list[int]:
    return [ID[w] for w in words.split()]


def write_jsonl(path, rows):
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)
