"""A synthetic instruction-following corpus in the InF-IR schema.

Every passage is about one *topic* and carries four *attributes*: region,
decade, document type and stance. Queries name a topic; instructions
constrain attributes. The instruction therefore decides relevance: two
passages on the query's topic differ only in whether their attributes
satisfy the instruction.

The surface forms differ on the two sides on purpose: an instruction says
"written by a journalist", the passage says "newspaper article"; an
instruction says "a European country", the passage names "Poland". A model
has to learn the mapping, it cannot copy words.

Training records (docs/method.md §1.3) are made by poisoning:
  I+ constrains attribute a to value v;   P+ is on topic t with a = v
  I- is I+ with v replaced by v' != v;    P1- is on topic t with a = v'
  Q- asks about topic t' != t;            P2- is on topic t' with a = v
The evaluation split is FollowIR-shaped: each query has an original
instruction (one constraint) and a changed, stricter one (two constraints),
a candidate pool, and qrels under both. Train and evaluation use disjoint
topics, so they share no query. Everything is a pure function of the seed.
"""
from __future__ import annotations

import numpy as np

from infjax.data.types import FollowIRSplit

# --- vocabulary ----------------------------------------------------------

TOPICS = (
    "solar panel recycling", "coral reef bleaching", "urban beekeeping", "microplastics in rivers",
    "remote work productivity", "electric bus fleets", "antibiotic resistance", "vertical farming",
    "minimum wage increases", "glacier retreat", "online tutoring platforms", "lithium mining",
    "rent control policies", "wildfire prevention", "telemedicine adoption", "plant-based meat",
    "high-speed rail projects", "childhood obesity", "cryptocurrency regulation", "desalination plants",
    "music streaming royalties", "urban heat islands", "four-day work weeks", "e-waste exports",
    "wind farm noise", "youth unemployment", "drought-resistant crops", "public library funding",
    "ride-hailing apps", "air pollution from shipping", "mobile banking", "honeybee decline",
    "carbon capture storage", "esports sponsorships", "nuclear power plant closures", "sugar taxes",
    "deep-sea mining", "bicycle lanes", "facial recognition cameras", "organic cotton farming",
    "hydrogen fuel cells", "pension reform", "invasive fish species", "smart thermostats",
    "school meal programs", "peatland restoration", "gig economy workers", "rainwater harvesting",
    "space debris tracking", "tourism overcrowding", "seaweed farming", "autonomous delivery robots",
    "mangrove replanting", "video game addiction", "rural broadband", "fast fashion waste",
    "heat pump installations", "tidal energy", "food delivery packaging", "language app learning",
)

CONTEXTS = (
    "local communities", "small businesses", "public budgets", "young families", "farmers",
    "city planners", "consumers", "workers", "researchers", "regulators",
)

QUERY_TEMPLATES = (
    "what is known about {topic}",
    "effects of {topic}",
    "{topic} impact",
    "information on {topic}",
    "how does {topic} affect people",
)

# attribute -> value -> (passage phrasings, instruction phrasings)
ATTRIBUTES: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "region": {
        "europe": (("Germany", "France", "Poland", "Spain", "Sweden"),
                   ("a European country", "somewhere in Europe")),
        "asia": (("Japan", "India", "Vietnam", "South Korea", "Indonesia"),
                 ("an Asian country", "somewhere in Asia")),
        "africa": (("Kenya", "Nigeria", "Ghana", "Ethiopia", "Senegal"),
                   ("an African country", "somewhere in Africa")),
        "latam": (("Brazil", "Chile", "Mexico", "Peru", "Colombia"),
                  ("a Latin American country", "somewhere in South or Central America")),
    },
    "decade": {
        "1990s": (("1992", "1994", "1996", "1998"), ("the 1990s", "the last decade of the twentieth century")),
        "2000s": (("2002", "2004", "2006", "2008"), ("the 2000s", "the first decade of this century")),
        "2020s": (("2021", "2022", "2023", "2024"), ("the 2020s", "the last few years")),
    },
    "doctype": {
        "news": (("newspaper article", "news report", "wire story"),
                 ("written by a journalist", "news coverage")),
        "research": (("peer-reviewed study", "academic paper", "laboratory report"),
                     ("scholarly research", "written by scientists")),
        "blog": (("personal blog post", "opinion column", "diary entry"),
                 ("a personal opinion piece", "written by an individual blogger")),
        "policy": (("government white paper", "ministry policy brief", "parliamentary report"),
                   ("an official government document", "issued by public authorities")),
    },
    "stance": {
        "positive": (("praises", "celebrates the benefits of", "strongly supports"),
                     ("favorable", "supportive")),
        "negative": (("criticizes", "warns about the harms of", "strongly opposes"),
                     ("critical", "opposed")),
    },
}
ATTRIBUTE_NAMES = tuple(ATTRIBUTES)

# How an instruction states one constraint, per attribute ({} is the phrasing).
CONSTRAINT_TEMPLATES = {
    "region": "it must be about {}",
    "decade": "it must date from {}",
    "doctype": "it must be {}",
    "stance": "its position must be {}",
}
INSTRUCTION_OPENERS = (
    "A relevant document satisfies this:",
    "Only count a document as relevant if",
    "Relevance rule:",
)


def _pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


def _random_attributes(rng: np.random.Generator) -> dict[str, str]:
    return {name: _pick(rng, tuple(values)) for name, values in ATTRIBUTES.items()}


def _other_value(rng: np.random.Generator, attribute: str, value: str) -> str:
    return _pick(rng, tuple(v for v in ATTRIBUTES[attribute] if v != value))


def passage_text(rng: np.random.Generator, topic: str, attrs: dict[str, str]) -> str:
    """A passage on `topic` whose wording encodes `attrs`."""
    place = _pick(rng, ATTRIBUTES["region"][attrs["region"]][0])
    year = _pick(rng, ATTRIBUTES["decade"][attrs["decade"]][0])
    kind = _pick(rng, ATTRIBUTES["doctype"][attrs["doctype"]][0])
    verb = _pick(rng, ATTRIBUTES["stance"][attrs["stance"]][0])
    context = _pick(rng, CONTEXTS)
    return (f"This {kind} from {place}, published in {year}, {verb} {topic}. "
            f"It describes what {topic} has meant for {context} in {place}.")


def instruction_text(rng: np.random.Generator, constraints: dict[str, str]) -> str:
    """An instruction stating each (attribute, value) constraint in instruction words."""
    clauses = [CONSTRAINT_TEMPLATES[a].format(_pick(rng, ATTRIBUTES[a][v][1])) for a, v in constraints.items()]
    return f"{_pick(rng, INSTRUCTION_OPENERS)} {' and '.join(clauses)}."


def query_text(rng: np.random.Generator, topic: str) -> str:
    return _pick(rng, QUERY_TEMPLATES).format(topic=topic)


def split_topics(seed: int, num_eval_topics: int = 15) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Disjoint (train, eval) topic lists, a permutation of TOPICS fixed by `seed`."""
    if not 1 <= num_eval_topics < len(TOPICS):
        raise ValueError(f"num_eval_topics must be in [1, {len(TOPICS) - 1}], got {num_eval_topics}")
    order = np.random.default_rng([seed, 0]).permutation(len(TOPICS))
    topics = [TOPICS[i] for i in order]
    return tuple(topics[num_eval_topics:]), tuple(topics[:num_eval_topics])


def _satisfies(attrs: dict[str, str], constraints: dict[str, str]) -> bool:
    return all(attrs[a] == v for a, v in constraints.items())


def make_train_records(num_records: int, seed: int, topics: tuple[str, ...] | None = None) -> list[dict]:
    """`num_records` InF-IR records (canonical field names), deterministic in `seed`."""
    if num_records < 1:
        raise ValueError(f"num_records must be >= 1, got {num_records}")
    topics = topics or split_topics(seed)[0]
    rng = np.random.default_rng([seed, 1])
    records = []
    for _ in range(num_records):
        topic = _pick(rng, topics)
        other_topic = _pick(rng, tuple(t for t in topics if t != topic))
        # One or two constrained attributes; the poisoned one is the first.
        n_constraints = 1 + int(rng.random() < 0.5)
        names = list(rng.choice(ATTRIBUTE_NAMES, size=n_constraints, replace=False))
        attrs = _random_attributes(rng)
        constraints = {a: attrs[a] for a in names}
        poisoned = dict(constraints)
        poisoned[names[0]] = _other_value(rng, names[0], constraints[names[0]])

        neg_attrs = dict(attrs, **poisoned)              # satisfies I-, violates I+
        other_attrs = _random_attributes(rng)
        other_attrs.update(constraints)                  # satisfies I+, other topic
        records.append({
            "instruction_positive": instruction_text(rng, constraints),
            "query_positive": query_text(rng, topic),
            "document_positive": passage_text(rng, topic, attrs),
            "instruction_negative": instruction_text(rng, poisoned),
            "query_negative": query_text(rng, other_topic),
            "hard_negative_document_1": passage_text(rng, topic, neg_attrs),
            "hard_negative_document_2": passage_text(rng, other_topic, other_attrs),
        })
    return records


def make_eval_split(num_queries: int, seed: int, pool_size: int = 24,
                    topics: tuple[str, ...] | None = None) -> FollowIRSplit:
    """`num_queries` FollowIR-style queries over `topics` (default: the held-out ones).

    Each pool has on-topic passages that satisfy the original constraint
    (some also the added one, some not: the latter are the documents whose
    relevance changes), on-topic passages that violate it, and off-topic ones.
    """
    if num_queries < 1:
        raise ValueError(f"num_queries must be >= 1, got {num_queries}")
    if pool_size < 8:
        raise ValueError(f"pool_size must be >= 8, got {pool_size}")
    topics = topics or split_topics(seed)[1]
    rng = np.random.default_rng([seed, 2])
    corpus, queries, ins_og, ins_new, cands, qrels_og, qrels_new = {}, {}, {}, {}, {}, {}, {}
    for qi in range(num_queries):
        qid = f"q{qi}"
        topic = topics[qi % len(topics)]
        first, second = rng.choice(ATTRIBUTE_NAMES, size=2, replace=False)
        target = _random_attributes(rng)
        og = {first: target[first]}
        changed = {first: target[first], second: target[second]}
        queries[qid] = query_text(rng, topic)
        ins_og[qid] = instruction_text(rng, og)
        ins_new[qid] = instruction_text(rng, changed)

        n_rel_both = pool_size // 6          # relevant under both instructions
        n_rel_og_only = pool_size // 4       # relevance changes: og-relevant, changed-irrelevant
        n_on_topic_wrong = pool_size // 4    # on topic, violates the original constraint
        n_off_topic = pool_size - n_rel_both - n_rel_og_only - n_on_topic_wrong
        docs = []
        for kind, count in (("both", n_rel_both), ("og_only", n_rel_og_only),
                            ("wrong", n_on_topic_wrong), ("off", n_off_topic)):
            for _ in range(count):
                attrs = _random_attributes(rng)
                doc_topic = topic
                if kind == "both":
                    attrs.update(changed)
                elif kind == "og_only":
                    attrs.update(og)
                    attrs[second] = _other_value(rng, second, target[second])
                elif kind == "wrong":
                    attrs[first] = _other_value(rng, first, target[first])
                else:
                    doc_topic = _pick(rng, tuple(t for t in topics if t != topic))
                docs.append((doc_topic, attrs))
        order = rng.permutation(len(docs))
        pool, rel_og, rel_new = [], {}, {}
        for j, k in enumerate(order):
            doc_topic, attrs = docs[k]
            did = f"{qid}-d{j}"
            corpus[did] = passage_text(rng, doc_topic, attrs)
            pool.append(did)
            on_topic = doc_topic == topic
            rel_og[did] = int(on_topic and _satisfies(attrs, og))
            rel_new[did] = int(on_topic and _satisfies(attrs, changed))
        cands[qid], qrels_og[qid], qrels_new[qid] = pool, rel_og, rel_new
    return FollowIRSplit(corpus, queries, ins_og, ins_new, cands, qrels_og, qrels_new)


def make_synthetic(seed: int, num_train: int, num_eval_queries: int,
                   pool_size: int = 24, num_eval_topics: int = 15) -> tuple[list[dict], FollowIRSplit]:
    """Training records and a FollowIR-style evaluation split over disjoint topics."""
    train_topics, eval_topics = split_topics(seed, num_eval_topics)
    return (make_train_records(num_train, seed, train_topics),
            make_eval_split(num_eval_queries, seed, pool_size, eval_topics))
