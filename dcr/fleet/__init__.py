"""A refit fleet of separate processes, described by one fleet file (TOML).

:mod:`dcr.fleet.config` reads the fleet file; the roles -- :mod:`~dcr.fleet.coordinator`,
:mod:`~dcr.fleet.owner`, :mod:`~dcr.fleet.receiver`, :mod:`~dcr.fleet.relay` -- each run in
their own process (``dcr <role> --fleet F``); :mod:`~dcr.fleet.launcher` starts, supervises
and stops a whole local fleet (``dcr fleet``, ``dcr demo``).  See ``docs/fleet.md``.
"""
