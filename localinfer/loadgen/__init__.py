"""Load generators: clients of the step engine or of a server, measuring them from the outside (not serving)."""
