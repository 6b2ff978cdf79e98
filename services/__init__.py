"""The five Tiller processes; each is run as ``python -m services.<name>``."""
