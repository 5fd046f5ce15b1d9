import sys

from resihp.cli import main

sys.exit(main())
