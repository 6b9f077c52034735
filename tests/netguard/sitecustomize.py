"""Python imports this at start-up when tests/netguard is on PYTHONPATH (tests/conftest.py
puts it there): every process the tests start refuses connections off this machine."""

import os

if os.environ.get("SHOAL_NETGUARD_LOG"):
    import shoal_netguard

    shoal_netguard.install()
