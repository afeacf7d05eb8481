"""Moving planned bytes: inside one process (:mod:`.local`), or through NIXL and Mooncake."""
