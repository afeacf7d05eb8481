"""How a decode endpoint receives, one mode per file (mirroring :mod:`..senders`): :mod:`.staged`."""
