"""The coordinator process: its gRPC servers, the core that joins reports and commands plans,
the decision engine, the journal, metrics and configuration.

Entry points: ``CoordinatorServer`` (server), ``CoordinatorCore`` (core: no gRPC),
``CoordinatorConfig`` (config), ``make_engine`` (engine), ``Journal`` / ``EventLog`` (journal),
``main`` (main: ``resihp coordinator``).
"""
