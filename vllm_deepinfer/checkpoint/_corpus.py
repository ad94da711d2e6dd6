"""Embedded English training text for the synthetic BPE tokenizer (written for this project).

`corpus_lines()` returns a deterministic list of lines: the prose below, plus sentences generated from
the word lists with a fixed-seed `random.Random`, plus numbers, code-like and chat-like snippets, so
that the tokenizer learns whole English words, common inflections, digits and punctuation.
"""

from __future__ import annotations

import random

PROSE = """
The morning was cold and clear, and the first light came slowly over the hills behind the old house.
She opened the window, listened to the birds in the garden, and decided that today she would finally write the letter.
Language models learn to predict the next word in a sentence by reading a very large amount of text.
A small model with random weights cannot say anything useful, but it can still produce words that look like text.
When you travel by train through the country, you see farms, rivers, small towns and long roads that disappear into the distance.
The library was quiet except for the sound of pages turning and the soft hum of the lights above the tables.
He asked a simple question, and the teacher answered with a story about a fisherman who could not read the weather.
Good software is tested carefully, documented clearly, and changed in small steps that anyone on the team can review.
The committee met on Tuesday to discuss the budget, the new building, and the plan for the summer program.
Water boils at one hundred degrees at sea level, but at high altitude it boils at a lower temperature.
In the city, people walk quickly, talk on their phones, and rarely stop to look at the buildings around them.
The children played in the park until the sun went down, and then they ran home for dinner.
Scientists measure the distance to stars by observing how their position appears to change over the year.
Every good recipe begins with fresh ingredients, a clean kitchen, and a little patience.
The river rose after three days of heavy rain, and the bridge was closed until the water went down.
Please read the instructions before you start, and ask for help if something is not clear.
Music can change the mood of a room, bring back old memories, and help people feel less alone.
The market opened early, and the farmers arranged apples, bread, cheese and flowers on their tables.
A computer stores numbers as bits, and every picture, song and document is finally just a long list of numbers.
She thanked everyone for coming, raised her glass, and wished them a happy and healthy new year.
The engine started with a loud noise, and the old car moved slowly out of the garage and into the street.
History teaches us that great changes often begin with small ideas shared by ordinary people.
The doctor said that he should rest, drink plenty of water, and come back next week if he did not feel better.
Our team will review the results, write a short report, and present the main findings at the next meeting.
The mountain path was narrow and steep, but the view from the top was worth every difficult step.
If the function receives an empty list, it should return zero instead of raising an error.
They built a small wooden boat, painted it blue, and named it after their grandmother.
The weather forecast says that it will be sunny in the morning and windy in the afternoon.
Reading a good book is like having a long conversation with someone who lived far away or long ago.
The company announced that it would open a new office and hire more engineers next year.
At night the sky was full of stars, and we could see the bright band of the Milky Way above the lake.
The students worked together on the project, shared their notes, and helped each other prepare for the exam.
He turned off the lights, locked the door, and walked down the quiet street toward the station.
What would you like to eat tonight? I think we should try the new restaurant near the river.
Thank you for your message. I will look into the problem and get back to you as soon as possible.
The quick brown fox jumps over the lazy dog, and the dog does not seem to care at all.
Once upon a time there was a king who had three daughters, and each of them wanted to see the world.
To understand a complex system, start with a simple model and add details only when they are needed.
The museum has a large collection of paintings, old maps, and tools that people used hundreds of years ago.
Our grandparents remember a time when there were no computers, no phones, and very few cars on the roads.
The answer is not always obvious, but careful thinking and honest discussion usually lead to a better result.
Hello! How are you today? I hope you are doing well and that the weather is nice where you live.
Sure, here is a short summary of the article, followed by a list of the most important points.
First, we load the data. Second, we clean it. Third, we train the model and evaluate it on the test set.
The train leaves at seven in the morning and arrives in the capital a little after noon.
There are many ways to solve this problem, and each of them has its own advantages and disadvantages.
The garden was full of roses, tulips and tall green grass that moved gently in the summer wind.
I do not know the answer yet, but I will think about it and tell you what I find.
In conclusion, the experiment shows that the new method is faster, simpler and more reliable than the old one.
"""

NOUNS = """time year people way day man woman child world life hand part place case week company system program
question work government number night point home water room mother area money story fact month lot right study
book eye job word business issue side kind head house service friend father power hour game line end member law
car city community name president team minute idea kid body information back parent face others level office door
health person art war history party result change morning reason research girl guy moment air teacher force
education foot boy age policy music market sense nation plan college interest death experience effect class
control care field development role effort rate heart drug show leader light voice wife police mind price report
decision son view relationship town road arm difference value building action model season society tax director
position player record paper space ground form event official matter center couple site project activity star
table need court oil situation cost industry figure street image phone data picture practice piece land product
doctor wall patient worker news test movie north love support technology step baby computer type attention film
tree source organization hair window evidence population site garden river mountain village country island forest
ocean sea lake bridge station train ship boat plane airport hospital school church library museum market shop
kitchen bread cheese apple orange coffee tea milk sugar salt dinner lunch breakfast meal recipe letter message
email network server memory file folder function variable value error answer problem solution method language
sentence paragraph chapter page title author reader student lesson exam grade dog cat horse bird fish animal
weather rain snow wind sun moon sky cloud storm summer winter spring autumn color song dance painting camera
machine engine wheel road map journey holiday hotel beach festival meeting budget plan report chart table token""".split()

VERBS = """be have do say go get make know think take see come want look use find give tell work call try ask need
feel become leave put mean keep let begin seem help talk turn start show hear play run move like live believe
hold bring happen write provide sit stand lose pay meet include continue set learn change lead understand watch
follow stop create speak read allow add spend grow open walk win offer remember love consider appear buy wait
serve die send expect build stay fall cut reach kill remain suggest raise pass sell require report decide pull
return explain hope develop carry break receive agree support hit produce eat cover catch draw choose cause point
listen travel paint cook clean visit answer close finish prepare improve measure compute train test load save
print check count sing smile laugh cry rest sleep dream plant climb swim fly drive ride jump wash""".split()

IRREGULAR = {
    "be": "was", "have": "had", "do": "did", "say": "said", "go": "went", "get": "got", "make": "made",
    "know": "knew", "think": "thought", "take": "took", "see": "saw", "come": "came", "give": "gave",
    "tell": "told", "find": "found", "feel": "felt", "become": "became", "leave": "left", "put": "put",
    "mean": "meant", "keep": "kept", "let": "let", "begin": "began", "hear": "heard", "run": "ran",
    "hold": "held", "bring": "brought", "write": "wrote", "sit": "sat", "stand": "stood", "lose": "lost",
    "pay": "paid", "meet": "met", "lead": "led", "understand": "understood", "speak": "spoke",
    "read": "read", "spend": "spent", "grow": "grew", "win": "won", "buy": "bought", "send": "sent",
    "build": "built", "fall": "fell", "cut": "cut", "break": "broke", "eat": "ate", "catch": "caught",
    "draw": "drew", "choose": "chose", "sing": "sang", "sleep": "slept", "fly": "flew", "drive": "drove",
    "ride": "rode", "swim": "swam", "hit": "hit", "set": "set", "die": "died",
}

ADJECTIVES = """good new first last long great little own other old right big high different small large next
early young important few public bad same able late hard major better economic strong possible whole free
military true federal international full special easy clear recent certain personal open red difficult
available likely short single medical current wrong private past foreign fine common poor natural significant
similar hot dead central happy serious ready simple left physical general environmental financial blue
democratic dark various entire close legal religious cold final main green nice huge popular traditional
cultural quiet bright warm gentle careful quick slow heavy light deep wide narrow tall fresh clean empty busy
beautiful strange famous ancient modern useful honest brave calm kind wild soft loud sweet golden silver""".split()

ADVERBS = """also very often however too usually really early never always sometimes together likely simply
generally instead actually again rather almost especially ever quickly probably already below directly
therefore else thus easily eventually exactly certainly normally currently extremely finally constantly
slowly carefully quietly gently suddenly clearly nearly recently""".split()

NAMES = """Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Leo Maria Nina Oscar Paul Quinn Rosa
Sam Tara Victor Wendy Anna Ben Clara Daniel Elena Felix Hannah Ivan Julia Kevin Laura Martin Olivia Peter
Sarah Thomas""".split()

PLACES = """London Paris Berlin Tokyo Rome Madrid Vienna Prague Lisbon Dublin Oslo Stockholm Cairo Delhi Sydney
Toronto Chicago Boston Seattle Denver Europe Asia Africa America Canada Japan China India Brazil Mexico Spain
Italy France Germany England Scotland Ireland Norway Sweden""".split()

FUNCTION = """the a an this that these those my your his her our their its some any every each no one two three
four five six seven eight nine ten hundred thousand of in on at by for with from to into over under about after
before between through during without within near and but or so because while if when where which who what how
why not all both many much more most less such than then there here it he she they we you I me him them us
can could will would should may might must shall""".split()

PREPOSITIONS = "in on at near under over behind beside across through into from with without toward around".split()

SUBJECT_PRONOUNS = "I you we they he she it".split()

CODE = """
def main():
    result = compute(data, steps=10)
    print(f"result: {result}")
    return 0

for i in range(len(items)):
    if items[i] is None:
        continue
    total += items[i] * weight

class Model(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)

    def forward(self, input_ids):
        return self.embed(input_ids)

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"role": "user", "content": "What is the capital of France?"}
{"role": "assistant", "content": "The capital of France is Paris."}
import numpy as np
import torch
x = np.zeros((4, 8), dtype=np.float32)
y = torch.tensor([1, 2, 3, 4])
if __name__ == "__main__":
    main()
# This is a comment that explains the next line of code.
// A short comment in another language.
SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY name;
https://www.example.com/docs/index.html
user@example.com
<tool_result>{"temperature": 21, "condition": "sunny"}</tool_result>
"""


def _past(v: str) -> str:
    if v in IRREGULAR:
        return IRREGULAR[v]
    if v.endswith("e"):
        return v + "d"
    if v.endswith("y") and v[-2] not in "aeiou":
        return v[:-1] + "ied"
    return v + "ed"


def _third(v: str) -> str:
    if v == "be":
        return "is"
    if v == "have":
        return "has"
    if v.endswith(("s", "sh", "ch", "x", "o")):
        return v + "es"
    if v.endswith("y") and v[-2] not in "aeiou":
        return v[:-1] + "ies"
    return v + "s"


def _ing(v: str) -> str:
    if v == "be":
        return "being"
    if v.endswith("ie"):
        return v[:-2] + "ying"
    if v.endswith("e") and not v.endswith("ee") and len(v) > 2:
        return v[:-1] + "ing"
    if len(v) <= 4 and v[-1] in "tpnmgbd" and v[-2] in "aeiou" and v[-3:-2] not in ("a", "e", "i", "o", "u", ""):
        return v + v[-1] + "ing"
    return v + "ing"


def _plural(n: str) -> str:
    irregular = {"man": "men", "woman": "women", "child": "children", "person": "people", "foot": "feet",
                 "mouse": "mice", "life": "lives", "wife": "wives", "knife": "knives", "leaf": "leaves"}
    if n in irregular:
        return irregular[n]
    if n.endswith(("s", "sh", "ch", "x")):
        return n + "es"
    if n.endswith("y") and n[-2] not in "aeiou":
        return n[:-1] + "ies"
    return n + "s"


def _sentence(rng: random.Random) -> str:
    def np_(plural: bool = False) -> str:
        noun = rng.choice(NOUNS)
        noun = _plural(noun) if plural else noun
        det = rng.choice(["the", "a", "this", "that", "my", "your", "our", "their", "his", "her", "every", "one"]) \
            if not plural else rng.choice(["the", "these", "those", "some", "many", "our", "their", "two", "three"])
        if det == "a" and noun[0] in "aeiou":
            det = "an"
        if rng.random() < 0.45:
            adj = rng.choice(ADJECTIVES)
            if det == "an" and adj[0] not in "aeiou":
                det = "a"
            elif det == "a" and adj[0] in "aeiou":
                det = "an"
            return f"{det} {adj} {noun}"
        return f"{det} {noun}"

    kind = rng.randrange(8)
    v = rng.choice(VERBS)
    if kind == 0:
        s = f"{np_()} {_third(v)} {np_(rng.random() < 0.4)} {rng.choice(PREPOSITIONS)} {np_()}."
    elif kind == 1:
        s = f"{rng.choice(NAMES)} {_past(v)} {np_()} {rng.choice(ADVERBS)} {rng.choice(PREPOSITIONS)} {rng.choice(PLACES)}."
    elif kind == 2:
        s = f"{rng.choice(SUBJECT_PRONOUNS)} {rng.choice(['will', 'can', 'should', 'might', 'must', 'would'])} {v} {np_(True)}."
    elif kind == 3:
        s = f"{rng.choice(['Why', 'How', 'When', 'Where'])} did {rng.choice(NAMES)} {v} {np_()}?"
    elif kind == 4:
        s = f"{np_(True)} were {_ing(v)} {rng.choice(ADVERBS)}, and {np_()} {_past(rng.choice(VERBS))} {np_()}."
    elif kind == 5:
        s = f"In {rng.randrange(1800, 2031)}, {rng.randrange(2, 1000)} {_plural(rng.choice(NOUNS))} {_past(v)} {rng.choice(PREPOSITIONS)} {rng.choice(PLACES)}."
    elif kind == 6:
        s = f"It is {rng.choice(ADJECTIVES)} to {v} {np_()} {rng.choice(['before', 'after', 'while', 'because'])} {rng.choice(SUBJECT_PRONOUNS)} {_past(rng.choice(VERBS))} {np_()}."
    else:
        s = f"{rng.choice(['There', 'Here'])} {rng.choice(['is', 'was'])} {np_()} {rng.choice(PREPOSITIONS)} {np_()}, {rng.choice(ADVERBS)} {_ing(v)}."
    s = s.replace(" I ", " I ")
    return s[0].upper() + s[1:]


def corpus_lines(n_generated: int = 30000, seed: int = 1234) -> list[str]:
    """The deterministic training text, one string per line/paragraph."""
    rng = random.Random(seed)
    lines: list[str] = []
    prose = [ln.strip() for ln in PROSE.strip().splitlines() if ln.strip()]
    lines += prose * 20
    lines += [CODE] * 30
    words = NOUNS + VERBS + ADJECTIVES + ADVERBS + FUNCTION
    lines += [" ".join(words), " ".join(w.capitalize() for w in words)]
    for v in VERBS:
        lines.append(f"{v} {_third(v)} {_past(v)} {_ing(v)} {v.capitalize()} {_ing(v).capitalize()}")
    for n in NOUNS:
        lines.append(f"the {n} of {_plural(n)} {n.capitalize()} {_plural(n).capitalize()}")
    for _ in range(n_generated):
        k = rng.randrange(1, 4)
        lines.append(" ".join(_sentence(rng) for _ in range(k)))
    for _ in range(2000):
        a, b = rng.randrange(0, 10000), rng.randrange(0, 1000)
        lines.append(f"{a} + {b} = {a + b}; {a}.{b:02d}% of {rng.randrange(100, 99999)} items cost ${rng.randrange(1, 999)}.{rng.randrange(0, 99):02d}")
    return lines
