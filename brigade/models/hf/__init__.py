"""Hugging Face checkpoints as brigade models: `--model hf:DIR` (families.py says which).

    model.py     the directory → a ModelSpec (blocks, batch, loss; `spec.hf` the rest)
    blocks.py    the family's own modules cut into blocks, with their side inputs
    weights.py   safetensors read tensor by tensor into the blocks a rank holds
    export.py    a run's snapshot back into a directory transformers loads

Needs the optional extra (`pip install -e '.[hf]'`); brigade without it still works.
"""
