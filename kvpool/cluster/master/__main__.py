"""``python -m kvpool.cluster.master``: one master process (see :func:`.server.main`)."""

import sys

from kvpool.cluster.master.server import main

sys.exit(main())
