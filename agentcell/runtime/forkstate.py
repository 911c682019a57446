"""State a code context inherits from the zygote that must not be the same in every sandbox.

Every sandbox of a template is a fork of one zygote process, so whatever the zygote's modules
computed at import time is identical in all of them. ``refresh()`` runs in each code-context process
(kernel._kernel_child) before user code and redraws what can be redrawn from the OS: pseudo-random
generators seeded at import, and caches of facts that are the sandbox's own (its host name).

What cannot be redrawn in a forked process (the ASLR layout, the str hash seed, the stack canary) is
listed in docs/architecture.md ("What sandboxes of one template share").
"""

from __future__ import annotations

import os
import sys


def refresh() -> None:
    """Reseed inherited generators from the OS; forget cached facts of the zygote. ~50 us."""
    # NumPy's legacy global RandomState (numpy.random.rand, pandas' sample() without a seed) is
    # seeded once, when the zygote imports numpy: without this every sandbox draws the same numbers.
    nprandom = sys.modules.get("numpy.random")
    if nprandom is not None:
        # The whole MT19937 key from the OS, as seed() does with less entropy and more work (its
        # SeedSequence writes ~0.2 MiB more of the pages this process shares with the zygote).
        key = sys.modules["numpy"].frombuffer(os.urandom(624 * 4), dtype="<u4").copy()
        key[0] = 0x80000000  # as seed(): only its top bit is used, and the key must not be all zero
        nprandom.set_state(("MT19937", key, 624, 0, 0.0))
    # Python's random module reseeds its global instance in every fork child by itself
    # (os.register_at_fork), but not in a process restored from a checkpoint (gvisor's templates).
    random = sys.modules.get("random")
    if random is not None:
        random.seed()
    # tempfile's name generator is its own Random, redrawn here.
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile._name_sequence = None  # type: ignore[attr-defined]
    # multiprocessing's authkey is a secret drawn at import.
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        mp_process.current_process().authkey = os.urandom(32)
    # uuid1()'s node and platform.uname() are cached by whoever asked first (the zygote): the
    # sandbox has its own host name and network.
    uuid = sys.modules.get("uuid")
    if uuid is not None:
        uuid._node = None  # type: ignore[attr-defined]
    platform = sys.modules.get("platform")
    if platform is not None:
        platform._uname_cache = None  # type: ignore[attr-defined]
