"""Typed run configuration: one dataclass per component, composed into `RunConfig`.

    sections.py   the dataclasses, and the part a snapshot must match (`config_hash`)
    fielddoc.py   `doc(default, "sentence")`: each field's help, read by --help and the TOML file
    sources.py    defaults ← TOML file ← flags (`build`), and TOML out (`to_toml`)
    validate.py   `validate`: values in range, no model, data or world needed
    precision.py  the precisions a run may name, and the autocast dtype each means
    recompute.py  the recompute modes a run may name
    launched.py   `Launched`: the processes a launcher started
    elastic.py    --nnodes MIN:MAX: the worlds a run can reach, its accumulation in each
    resolve.py    `resolve_layout`: dp from the world, derived once; `degrees_of`: the world's degrees
"""

from brigade.config.launched import Launched
from brigade.config.resolve import degrees_of, pipeline_shape, resolve_layout
from brigade.config.sections import (
    SECTIONS,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    config_hash,
    config_subset,
    field_types,
    section_classes,
)
from brigade.config.sources import add_flags, build, load_toml, to_toml
from brigade.config.validate import validate
from brigade.host.net import parse_endpoint

__all__ = ["SECTIONS", "DataConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "RunConfig",
           "TrainConfig", "Launched", "add_flags", "build", "config_hash", "config_subset", "degrees_of",
           "field_types",
           "load_toml", "parse_endpoint", "pipeline_shape", "resolve_layout", "section_classes", "to_toml",
           "validate"]
