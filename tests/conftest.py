def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test; runs only with GRAPHOPT_SLOW=1")
