"""graphopt_service: the gRPC adapter over the graphopt library (the library knows nothing
of gRPC). The wire contract is proto/graphopt/v1/graphopt.proto."""
