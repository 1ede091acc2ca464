"""Command lines: ``kvpool-server`` (:mod:`.server`, which runs the roles of :mod:`.serve`) and
``kvpool`` (:mod:`.tool`). ``python -m kvpool.cli`` is ``kvpool``."""
