"""Pure "how big, how many, when": sizing, usage, forecast, green hours, capacity windows."""
