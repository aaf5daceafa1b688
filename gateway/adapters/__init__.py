"""LoRA adapters: which names are adapters of which base model (``catalogue``), and loading them on
the engines routing picks when none holds them (``loader``)."""
