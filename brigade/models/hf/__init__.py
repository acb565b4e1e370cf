"""Hugging Face checkpoints as brigade models: `--model hf:DIR` (families.py says which).

    model.py     the directory → a ModelSpec (blocks, batch, loss; `spec.hf` the rest)
    blocks.py    the family's own modules cut into blocks, with their side inputs
    weights.py   safetensors read tensor by tensor into the blocks a rank holds
    tiny.py      a tiny random directory with a tokenizer (tests, docs)
    deps.py      the optional extra, imported where needed with a one-line refusal when missing

A run's snapshot goes back into a directory by `brigade.train.export` (it reads snapshots,
which models do not), and `--data` is tokenized by `brigade.data.tokenize`.

Needs the optional extra (`pip install -e '.[hf]'`); brigade without it still works.
"""
