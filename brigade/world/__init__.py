"""The parallel world: the one owner of every degree, the DeviceMesh, and rank ↔ coordinates.

    degrees.py  `Degrees`: replicate × shard × pp × cp × tp (and ep, carved from dp), checked in one
                place; a rank's coordinates and every group's ranks (no torch import)
    mesh.py     `World`: this process's place, the one DeviceMesh built from the degrees, and every
                process group and sub-mesh the rest of brigade asks for

Nothing else in brigade builds a DeviceMesh or computes a rank from coordinates
(tests/test_imports.py holds that). This package's `__init__` imports nothing, so `degrees`
stays free of torch.
"""
