"""Drop-in replacements for the helpers serving engines use today."""
