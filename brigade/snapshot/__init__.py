"""Snapshots, one owner: the on-disk format and its typed manifest (`format`), saving and loading
across ranks (`collective`), whether a snapshot fits a configuration (`compat`), and each rank's
random-number generator states (`rng`)."""
