"""Reading assistant-only loss masks back as text."""


def masked_runs(tok, ids, mask) -> list[str]:
    """Decode each contiguous run of mask==1 tokens separately."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs]
