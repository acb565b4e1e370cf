import sys

from brigade.cli import main

sys.exit(main())
