"""Support shared by kiln's Python suites (tests/sdk and tests/abuse).

- `framework.skip`: the skip policy. A test that needs something this host may lack fails naming
  it, unless KILN_ALLOW_SKIPS=1 turns that into a pytest skip (shown with `-rs`); never a silent
  pass. The Rust tests follow the same policy (crates/testkit).
- `framework.server`: a real `kiln serve` on a free port with a temporary state dir
  (`KilnServer`, `own_server`), what a server leaves behind and its clean-up (`cleanup_state`,
  `mounts_under`, `runsc_processes_for`, network slots), and the hooks that keep a failed test's
  server logs.

The suites' pytest.ini put tests/ on sys.path (`pythonpath = ..`), so `import framework` works
from either.
"""
