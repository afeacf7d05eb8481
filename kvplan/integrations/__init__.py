"""kvplan inside serving engines: adapters over their own disaggregation interfaces."""
