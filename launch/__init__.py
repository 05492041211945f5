"""The ``kvroute`` command line and the local and Ray cluster launchers."""
