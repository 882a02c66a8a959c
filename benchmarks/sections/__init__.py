"""The sections of a suite run, one module each (``run_section(suite)``), and the
commands with options of their own (``routing_real``, ``restart_real``, ``restart_fleet``:
``main(argv)``)."""
