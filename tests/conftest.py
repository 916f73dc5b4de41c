def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow'; GRAPHOPT_SLOW=0 skips it)")


# CI sets GRAPHOPT_NO_SKIPS=1: there, every dependency is installed and the machine can do what
# every test asks, so a skipped test is a check that silently did not run (a renamed module
# behind an importorskip skipped nine tests that way), and the run fails.
SKIPS_FAIL_ENV = "GRAPHOPT_NO_SKIPS"


def pytest_sessionfinish(session, exitstatus):
    import os
    if os.environ.get(SKIPS_FAIL_ENV) != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped and exitstatus == 0:
        reporter.write_line(f"{SKIPS_FAIL_ENV}=1 and {len(skipped)} test(s) skipped: "
                            + ", ".join(r.nodeid for r in skipped[:10]), red=True)
        session.exitstatus = 1
