"""``python -m dcr.adapters.transport.relay node|receiver ...``: one relay node, or one receiver,
in a process of its own (:func:`~dcr.adapters.transport.relay.processes.main`)."""

import sys

from dcr.adapters.transport.relay.processes import main

if __name__ == "__main__":
    main(sys.argv[1:])
