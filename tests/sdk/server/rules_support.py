"""What the anomaly-detection suites share: a `kiln serve` they start and take down whole, and
the alerts it reports for a sandbox."""

import contextlib
import shutil

from .conftest import KilnServer, cleanup_state
from .internet import remove_slots_in_range


@contextlib.contextmanager
def rules_server(base: str, args: list, label: str, expect: str, net_range: str = None):
    """Starts `kiln serve ARGS` on a state dir under `base` and checks its log names `expect`
    (how many rules it loaded); afterwards kills its sandboxes, stops it, prints its log's
    tail under `label`, removes its state (and the network slots of `net_range`) and `base`,
    and fails if it panicked."""
    s = KilnServer(f"{base}/state", args)
    try:
        s.start()
        assert expect in s.log(), s.log()
        yield s
    finally:
        s.kill_all_sandboxes()
        s.stop()
        log = s.log()
        print(f"---- kiln serve ({label}) log (tail) ----\n" + log[-6000:])
        cleanup_state(s.state_dir)
        if net_range:
            remove_slots_in_range(net_range.split("/")[0].rsplit(".", 1)[0] + ".")
        shutil.rmtree(base, ignore_errors=True)
        assert "panicked" not in log, log


def alerts(srv, sandbox_id):
    """The sandbox's alerts (incidents), oldest first."""
    status, page, _ = srv.request("GET", f"/alerts?sandboxID={sandbox_id}&limit=1000")
    assert status == 200, page
    return page["alerts"]
