"""The `Plan` and what it is made of: its config, its JSON form, its explanation, its cost record."""
