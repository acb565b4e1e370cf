"""When the head's loss runs chunk by chunk (no torch import): the configuration owns the names
and what each means; `brigade.parallel.chunked` does it."""

from __future__ import annotations

MODES = {
    "auto": "where a micro-batch's logits reach 64 Mi elements (256 MiB in fp32) and the schedule does "
            "not split backwards into I and W",
    "on": "whenever a sequence spans two chunks, under any schedule that does not split backwards",
    "off": "the head makes the whole sequence's logits, as the model's own forward does",
}
