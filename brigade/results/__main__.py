"""`python -m brigade.results`: regenerate every file in results/ and print the results table
(`regenerate.py`; scripts/results.sh runs it)."""

from brigade.results.regenerate import main

raise SystemExit(main())
