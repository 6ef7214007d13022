"""Sandbox runtimes (bwrap, apptainer, process) and the in-sandbox execution server."""
