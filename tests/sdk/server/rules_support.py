"""What the anomaly-detection suites share: the alerts a server reports for a sandbox."""


def alerts(srv, sandbox_id):
    """The sandbox's alerts (incidents), oldest first."""
    status, page, _ = srv.request("GET", f"/alerts?sandboxID={sandbox_id}&limit=1000")
    assert status == 200, page
    return page["alerts"]
