"""A third-party package that plugs adapters into dcr through entry points (a test fixture).

It uses only dcr's public adapter interfaces: a transport (``spool``), a commit store
(``jsonfile``) and a trainer factory, each built from a fleet file section by its own
``from_config``.
"""
