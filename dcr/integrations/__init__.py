"""dcr receivers inside serving engines; each integration imports its engine only when used."""
