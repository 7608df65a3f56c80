"""Everything that touches the outside world, each kind behind a small ABC."""
