"""What a transport loop runs on: one wait on everything that can make progress (:mod:`.loop`)."""
