"""Snapshots, one owner: the on-disk format and its typed manifest (`format`), saving and loading
across ranks (`collective`), whether a snapshot fits a configuration (`compat`), each rank's
random-number generator states (`rng`), and a tied weight stored once (`ties`)."""
