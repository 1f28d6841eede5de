"""The sentence forms of the English memory episodes (:mod:`.english`): how each relation is stated,
updated and asked, and the chatter between the facts.

Each relation names its value ``kind`` (a pool of :mod:`.english_words`, or a number kind), the word
that completes its key beside the person (``key``: the pet's animal, the kept thing, ...), and for
each split its forms:

* ``said``: a statement in the third person (notes, or one person telling about another);
* ``self``: the person states it in the first person (``"Maria: I live in Lisbon now."``);
* ``update``, ``update_self``: a later statement that replaces the value (``{old}`` the previous one);
* ``ask``: the question.

Slots: ``{name}``, ``{value}``, ``{old}``, ``{a_value}``/``{a_old}`` (with ``a``/``an``), and the key's
``{animal}``, ``{thing}``, ``{event}``, ``{item}``, ``{other}`` (a second person). The ``"train"`` and
``"heldout"`` forms are different sentences (``tests/test_english_episodes.py`` checks that no line of
one split reads as a form of the other); ``birthplace`` and ``instrument`` have held-out forms only.
"""

from __future__ import annotations

RELATIONS: dict[str, dict] = {
    "city": {
        "kind": "city",
        "train": {
            "said": [
                "{name} lives in {value}.",
                "{name} moved to {value} last year.",
                "{name}'s flat is in {value}.",
            ],
            "self": ["I'm {name}, and my home is in {value}.", "I live in {value} these days."],
            "update": [
                "Actually, {name} moved from {old} to {value}.",
                "{name} no longer lives in {old}; the new flat is in {value}.",
            ],
            "update_self": ["Small update: I left {old}, I live in {value} now."],
            "ask": [
                "Where does {name} live?",
                "Which city does {name} live in?",
                "What city is {name}'s flat in?",
            ],
        },
        "heldout": {
            "said": ["{name} has a house in {value}.", "Home for {name} is {value}."],
            "self": ["My address is in {value}, by the way."],
            "update": ["News: {name} left {old} and settled in {value}."],
            "update_self": ["I packed up and relocated from {old} to {value}."],
            "ask": ["In which city does {name} reside?", "Remind me, where is {name} based?"],
        },
    },
    "job": {
        "kind": "job",
        "train": {
            "said": [
                "{name} works as {a_value}.",
                "{name} is {a_value} by trade.",
                "{name} trained as {a_value}.",
            ],
            "self": ["I'm {name}; I work as {a_value}.", "My job? I'm {a_value}."],
            "update": [
                "{name} stopped working as {a_old} and is now {a_value}.",
                "Career change: {name} is {a_value} now.",
            ],
            "update_self": ["I changed jobs; I'm {a_value} now, not {a_old}."],
            "ask": [
                "What does {name} do for a living?",
                "What is {name}'s job?",
                "What work does {name} do?",
            ],
        },
        "heldout": {
            "said": ["{name} earns a living as {a_value}.", "By profession, {name} is {a_value}."],
            "self": ["For work, I am {a_value}."],
            "update": ["Nowadays {name} is employed as {a_value} rather than {a_old}."],
            "update_self": ["I retrained: no longer {a_old}, I am {a_value} now."],
            "ask": ["What is {name}'s profession?", "How does {name} earn money?"],
        },
    },
    "pet": {
        "kind": "pet",
        "key": "animal",
        "train": {
            "said": [
                "{name} has a {animal} called {value}.",
                "{name}'s {animal} is named {value}.",
                "{value} is the name of {name}'s {animal}.",
            ],
            "self": ["My {animal} is called {value}.", "I'm {name}, and I have a {animal} named {value}."],
            "update": [
                "{name}'s {animal} was renamed from {old} to {value}.",
                "Correction: {name}'s {animal} is called {value}, not {old}.",
            ],
            "update_self": ["We renamed our {animal}; it is {value} now, not {old}."],
            "ask": [
                "What is {name}'s {animal} called?",
                "What is the name of {name}'s {animal}?",
                "What did {name} name the {animal}?",
            ],
        },
        "heldout": {
            "said": [
                "{name} looks after a {animal} that answers to {value}.",
                "The {animal} that lives with {name} goes by {value}.",
            ],
            "self": ["Our {animal} answers to {value}."],
            "update": ["{name} now calls the {animal} {value} instead of {old}."],
            "update_self": ["The {animal} is {value} from now on; {old} never suited it."],
            "ask": ["Which name does {name}'s {animal} answer to?", "How is {name}'s {animal} called?"],
        },
    },
    "age": {
        "kind": "age",
        "train": {
            "said": [
                "{name} is {value} years old.",
                "{name} turned {value} this spring.",
                "{name}'s age is {value}.",
            ],
            "self": ["I'm {name} and I'm {value} years old.", "I turned {value} in the spring."],
            "update": [
                "Correction: {name} is {value}, not {old}.",
                "{name} is actually {value}; {old} was wrong.",
            ],
            "update_self": ["Sorry, I said {old} before, but I am {value}."],
            "ask": ["How old is {name}?", "What is {name}'s age?", "How many years old is {name}?"],
        },
        "heldout": {
            "said": ["{name} was born {value} years ago.", "{name} has lived for {value} years."],
            "self": ["I have been around for {value} years."],
            "update": ["Turns out {name} is {value} years of age rather than {old}."],
            "update_self": ["My real age is {value}, not {old}."],
            "ask": ["What age is {name}?", "How many years has {name} been alive?"],
        },
    },
    "food": {
        "kind": "food",
        "train": {
            "said": [
                "{name}'s favourite food is {value}.",
                "{name} loves {value} more than anything.",
                "Nothing makes {name} happier than {value}.",
            ],
            "self": ["My favourite food is {value}.", "I could eat {value} every day."],
            "update": [
                "{name} has gone off {old}; the new favourite is {value}.",
                "These days {name} prefers {value} to {old}.",
            ],
            "update_self": ["I used to love {old}, but now it's {value} for me."],
            "ask": [
                "What is {name}'s favourite food?",
                "Which dish does {name} love most?",
                "What food does {name} like best?",
            ],
        },
        "heldout": {
            "said": [
                "Given the choice, {name} always orders {value}.",
                "{name} craves {value} at every meal.",
            ],
            "self": ["If I could pick one dish, it would be {value}."],
            "update": ["{name} switched allegiance from {old} to {value}."],
            "update_self": ["Forget {old}; my top dish is {value} lately."],
            "ask": ["Which dish is {name}'s top pick?", "What would {name} eat at every meal if possible?"],
        },
    },
    "colour": {
        "kind": "colour",
        "train": {
            "said": [
                "{name}'s favourite colour is {value}.",
                "{name} paints everything {value}.",
                "{name} likes {value} best of all colours.",
            ],
            "self": ["My favourite colour is {value}.", "I always pick {value} when I can."],
            "update": [
                "{name} now prefers {value} over {old}.",
                "Correction: {name}'s favourite colour is {value}, not {old}.",
            ],
            "update_self": ["I'm over {old}; {value} is my colour now."],
            "ask": [
                "What is {name}'s favourite colour?",
                "Which colour does {name} like best?",
                "What colour does {name} prefer?",
            ],
        },
        "heldout": {
            "said": ["{name} wears {value} whenever possible.", "The colour {name} adores is {value}."],
            "self": ["Everything I own is {value}."],
            "update": ["{name} went from loving {old} to loving {value}."],
            "update_self": ["I fell out of love with {old}; {value} suits me better."],
            "ask": ["Which shade does {name} adore?", "What colour would {name} pick for everything?"],
        },
    },
    "partner": {
        "kind": "name",
        "train": {
            "said": [
                "{name} is married to {value}.",
                "{name}'s partner is {value}.",
                "{name} and {value} have been together for years.",
            ],
            "self": ["I'm {name}, and my partner is {value}.", "My partner {value} says hello."],
            "update": [
                "{name} and {old} split up; {name} is with {value} now.",
                "{name}'s new partner is {value}.",
            ],
            "update_self": ["{old} and I broke up; I'm with {value} now."],
            "ask": ["Who is {name}'s partner?", "Who is {name} married to?", "Who is {name} together with?"],
        },
        "heldout": {
            "said": ["{name} shares a life with {value}.", "{value} is the spouse of {name}."],
            "self": ["My other half is {value}."],
            "update": ["Big news: {name} left {old} for {value}."],
            "update_self": ["Lately my significant other is {value}, not {old}."],
            "ask": ["Who is {name}'s spouse?", "Who does {name} share a life with?"],
        },
    },
    "meeting": {
        "kind": "venue",
        "key": "other",
        "train": {
            "said": [
                "{name} is meeting {other} at the {value}.",
                "{name} and {other} agreed to meet at the {value}.",
                "The plan: {name} meets {other} at the {value}.",
            ],
            "self": ["I'm meeting {other} at the {value}.", "{other} and I will meet at the {value}."],
            "update": [
                "Change of plan: {name} and {other} will meet at the {value}, not the {old}.",
                "{name} moved the meeting with {other} from the {old} to the {value}.",
            ],
            "update_self": ["We moved it: {other} and I meet at the {value} instead of the {old}."],
            "ask": [
                "Where is {name} meeting {other}?",
                "Where will {name} and {other} meet?",
                "At which place are {name} and {other} meeting?",
            ],
        },
        "heldout": {
            "said": [
                "{name} arranged to see {other} at the {value}.",
                "{name} will catch up with {other} by the {value}.",
            ],
            "self": ["{other} will find me at the {value}."],
            "update": ["{name} and {other} now plan to gather at the {value} rather than the {old}."],
            "update_self": ["New spot for me and {other}: the {value}, forget the {old}."],
            "ask": [
                "What is the meeting spot for {name} and {other}?",
                "Where did {name} arrange to see {other}?",
            ],
        },
    },
    "appointment": {
        "kind": "date",
        "key": "event",
        "train": {
            "said": [
                "{name}'s {event} is on {value}.",
                "{name} has the {event} on {value}.",
                "{name} booked the {event} for {value}.",
            ],
            "self": ["My {event} is on {value}.", "I have the {event} on {value}."],
            "update": [
                "{name}'s {event} moved from {old} to {value}.",
                "The {event} for {name} is now on {value}, not {old}.",
            ],
            "update_self": ["My {event} got moved to {value}; it was {old}."],
            "ask": [
                "When is {name}'s {event}?",
                "On what date is {name}'s {event}?",
                "What day is {name}'s {event} on?",
            ],
        },
        "heldout": {
            "said": [
                "The date of {name}'s {event} is {value}.",
                "{name} marked {value} in the calendar for the {event}.",
            ],
            "self": ["Put {value} down for my {event}."],
            "update": ["{name} postponed the {event} from {old} until {value}."],
            "update_self": ["My {event} was rescheduled, so {value} instead of {old}."],
            "ask": ["Which date is set for {name}'s {event}?", "For when is {name}'s {event} scheduled?"],
        },
    },
    "room": {
        "kind": "room",
        "train": {
            "said": [
                "{name} is staying in room {value}.",
                "{name}'s hotel room is number {value}.",
                "Room {value} is where {name} is staying.",
            ],
            "self": ["I'm in room {value}.", "My room number is {value}."],
            "update": [
                "{name} switched from room {old} to room {value}.",
                "{name} is in room {value} now, not {old}.",
            ],
            "update_self": ["They moved me from room {old} to room {value}."],
            "ask": [
                "Which room is {name} staying in?",
                "What is {name}'s room number?",
                "What room is {name} in?",
            ],
        },
        "heldout": {
            "said": [
                "The key for room {value} was handed to {name}.",
                "{name} sleeps in room {value} at the guesthouse.",
            ],
            "self": ["Knock on door {value} if you need me."],
            "update": ["Reception put {name} in room {value} after room {old} flooded."],
            "update_self": ["Door {old} is not mine anymore; try door {value}."],
            "ask": ["What number is on {name}'s door?", "In which room does {name} sleep?"],
        },
    },
    "extension": {
        "kind": "extension",
        "train": {
            "said": [
                "{name}'s phone extension is {value}.",
                "You can reach {name} on extension {value}.",
                "Extension {value} rings at {name}'s desk.",
            ],
            "self": ["My extension is {value}.", "Call me on extension {value}."],
            "update": [
                "{name}'s extension changed from {old} to {value}.",
                "New extension for {name}: {value}, not {old}.",
            ],
            "update_self": ["My extension is {value} now; {old} is gone."],
            "ask": [
                "What is {name}'s phone extension?",
                "Which extension reaches {name}?",
                "On what extension can you call {name}?",
            ],
        },
        "heldout": {
            "said": [
                "Dial {value} on the office line to get {name}.",
                "The internal number for {name} is {value}.",
            ],
            "self": ["Ring {value} on the internal line for me."],
            "update": ["{name} gave up line {old} and picked up line {value}."],
            "update_self": ["Internal line {old} no longer reaches me; use {value}."],
            "ask": [
                "Which internal number gets through to {name}?",
                "What do you dial to reach {name} at the office?",
            ],
        },
    },
    "price": {
        "kind": "price",
        "key": "item",
        "train": {
            "said": [
                "{name} paid {value} dollars for the {item}.",
                "The {item} cost {name} {value} dollars.",
                "{name} bought the {item} for {value} dollars.",
            ],
            "self": ["I paid {value} dollars for the {item}.", "The {item} set me back {value} dollars."],
            "update": [
                "Correction: {name}'s {item} cost {value} dollars, not {old}.",
                "{name} got a refund, so the {item} cost {value} dollars instead of {old}.",
            ],
            "update_self": ["Oops, the {item} was {value} dollars, not {old}."],
            "ask": [
                "How much did {name} pay for the {item}?",
                "What did the {item} cost {name}?",
                "How many dollars did {name} spend on the {item}?",
            ],
        },
        "heldout": {
            "said": [
                "{name} handed over {value} dollars to get the {item}.",
                "The price tag on {name}'s {item} read {value} dollars.",
            ],
            "self": ["My {item} was a bargain at {value} dollars."],
            "update": ["After haggling, {name} spent {value} dollars on the {item} rather than {old}."],
            "update_self": ["The {item} ended up at {value} dollars for me, down from {old}."],
            "ask": ["What price did {name} pay for the {item}?", "How expensive was {name}'s {item}?"],
        },
    },
    "keeps": {
        "kind": "place",
        "key": "thing",
        "train": {
            "said": [
                "{name} keeps the {thing} in the {value}.",
                "{name}'s {thing} is in the {value}.",
                "The {thing} of {name} is stored in the {value}.",
            ],
            "self": ["I keep the {thing} in the {value}.", "My {thing} is in the {value}."],
            "update": [
                "{name} moved the {thing} from the {old} to the {value}.",
                "The {thing} of {name} is in the {value} now, not the {old}.",
            ],
            "update_self": ["I moved the {thing} out of the {old} and into the {value}."],
            "ask": [
                "Where does {name} keep the {thing}?",
                "Where is {name}'s {thing}?",
                "In what place does {name} store the {thing}?",
            ],
        },
        "heldout": {
            "said": [
                "{name} tucked the {thing} away in the {value}.",
                "Look in the {value} for {name}'s {thing}.",
            ],
            "self": ["If you need my {thing}, check the {value}."],
            "update": ["{name} hid the {thing} in the {value} after keeping it in the {old}."],
            "update_self": ["The {thing} went from the {old} to the {value}; I hid it better."],
            "ask": ["Where would you find {name}'s {thing}?", "Where has {name} tucked the {thing} away?"],
        },
    },
    # held out entirely: training never states nor asks these
    "birthplace": {
        "kind": "city",
        "heldout": {
            "said": ["{name} was born in {value}.", "{value} is where {name} was born."],
            "self": ["I was born in {value}."],
            "update": ["{name}'s birthplace is {value}, not {old} as I said earlier."],
            "update_self": ["I was mixed up: I was born in {value}, not {old}."],
            "ask": ["Where was {name} born?", "Which city is {name}'s birthplace?"],
        },
    },
    "instrument": {
        "kind": "instrument",
        "heldout": {
            "said": ["{name} plays the {value}.", "{name} practises the {value} every evening."],
            "self": ["I play the {value} in a small band."],
            "update": ["{name} gave up the {old} and took up the {value}."],
            "update_self": ["I swapped the {old} for the {value}."],
            "ask": ["Which instrument does {name} play?", "What instrument does {name} practise?"],
        },
    },
}

#: Relations training never sees (held-out episodes may ask any relation).
HELDOUT_RELATIONS = ("birthplace", "instrument")

#: Chatter: ``when + " " + what + "."`` or a ``talk`` line; it names no person and states no value.
CHATTER = {
    "train": {
        "when": [
            "This morning",
            "Yesterday",
            "Last night",
            "Earlier today",
            "On the way home",
            "Over lunch",
            "At the weekend",
            "Around noon",
            "Just now",
            "After dinner",
        ],
        "what": [
            "the bus was late again",
            "it rained for an hour",
            "the printer jammed twice",
            "someone left a cake in the office",
            "the neighbours had a loud party",
            "the lift was out of order",
            "the wifi kept dropping",
            "the sky cleared up",
            "a stray balloon floated past the window",
            "the queue at the post office was huge",
            "I finished a long crossword",
            "the heating finally came on",
            "the road was closed for repairs",
            "I could not find a parking spot",
            "the trains were running slowly",
            "a loud storm rolled through",
            "the shop ran out of milk",
            "I watched a documentary about whales",
            "the market was very crowded",
            "my umbrella broke in the wind",
            "a delivery arrived for the wrong flat",
            "the power went out briefly",
            "I repotted a few plants",
            "the fog was thick by the river",
            "we played a quiz and lost",
            "the town was full of tourists",
            "I walked further than planned",
            "the new series was disappointing",
            "the dishwasher started leaking",
            "everyone talked about the match",
        ],
        "talk": [
            "How is everyone doing?",
            "That sounds lovely.",
            "Ha, same here.",
            "Hope the week gets better.",
            "Anyone up for a walk later?",
            "I need more coffee.",
            "Fair enough.",
            "Let us catch up soon.",
            "Good point.",
            "Thanks for the update.",
            "What a day.",
            "I will think about it.",
        ],
    },
    "heldout": {
        "when": [
            "Late this afternoon",
            "The other day",
            "Before breakfast",
            "During the break",
            "Over the holidays",
        ],
        "what": [
            "the ferry was cancelled",
            "the hallway smelled of paint",
            "a pigeon got into the station",
            "the boiler made strange noises",
            "the snow turned to slush",
            "the band next door practised for hours",
            "a kite got stuck in a tree",
            "I reorganised the spice rack",
            "the streetlights kept flickering",
            "the tram was packed",
            "the crossword defeated me",
            "the ceiling fan squeaked",
        ],
        "talk": [
            "Lovely to hear from you all.",
            "What a week it has been.",
            "Shall we do this again soon?",
            "Quite right.",
            "Count me in.",
            "No rush at all.",
        ],
    },
}

#: What the assistant answers to a turn that states a fact, and to a turn of chatter.
ACKNOWLEDGEMENTS = {
    "train": ["Noted.", "Got it.", "Thanks, I will remember that.", "Okay, noted."],
    "heldout": ["Understood.", "All right, I have that down."],
}
REPLIES = {
    "train": ["That sounds nice.", "Oh no!", "I see.", "Good to hear."],
    "heldout": ["How interesting.", "Sorry to hear that."],
}
