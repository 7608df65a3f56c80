"""``python -m dcr.integrations.vllm``: see :mod:`dcr.integrations.vllm.server`."""

from dcr.integrations.vllm.server import main

if __name__ == "__main__":
    raise SystemExit(main())
