import sys

from kvpool.cli.tool import main

sys.exit(main())
