"""The optional extra `hf:` models need: transformers, safetensors and tokenizers.

brigade without them still works; naming an `hf:` directory without them says how to install.
"""

from __future__ import annotations

import importlib

from brigade.errors import BrigadeError

INSTALL = "pip install -e '.[hf]' (or pip install transformers safetensors tokenizers)"


def require(module: str):
    """Import `module` (transformers, safetensors, tokenizers), or say how to install it.

    Raises:
        BrigadeError: the package is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise BrigadeError(f"--model hf:DIR needs the package {module.split('.')[0]!r}, which is not "
                           f"installed: {INSTALL}") from None
